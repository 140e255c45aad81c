"""Child processes (a capture backend's, the tokenize workers): how one ended, in words, and dying with the
parent that started it."""

from __future__ import annotations

import ctypes
import os
import signal
import time
from multiprocessing import resource_tracker
from typing import Any

__all__ = ["describe_exit", "set_parent_death_signal", "settle_resource_tracker"]


def describe_exit(code: int | None) -> str:
    """How a process ended, for a message: ``was killed by signal 9 SIGKILL (...)``, ``exited with code 1``."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = ""
        if -code == signal.SIGKILL:
            hint = " (SIGKILL: killed by hand, or by the kernel's out-of-memory killer: see `dmesg`)"
        elif -code == signal.SIGSEGV:
            hint = " (a crash in native code)"
        return f"was killed by signal {-code} {name}{hint}"
    return f"exited with code {code}" + (" (see its error output above)" if code else "")


def set_parent_death_signal(parent_pid: int) -> None:
    """Linux: this process gets SIGKILL when its parent dies (``PR_SET_PDEATHSIG``); exits at once if it has."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def settle_resource_tracker(timeout: float = 3.0) -> None:
    """Before a process that ran child processes prints its last line and exits: let go of multiprocessing's
    resource tracker and wait up to ``timeout`` s for it to end, so that what it prints when it cleans up after
    a child that was killed (``resource_tracker: There appear to be 1 leaked semaphore objects``) comes before
    that line, not after the process is gone. Only at exit: the tracker unlinks what is still registered."""
    tracker: Any = resource_tracker._resource_tracker  # private: its fd and pid (Python 3.8 to 3.13)
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if fd is None or pid is None:
        return
    tracker._fd = tracker._pid = None  # a later use starts a new tracker
    os.close(fd)  # the tracker ends once every process holding this pipe (ours, our children's) closed it
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                return
        except ChildProcessError:
            return
        time.sleep(0.02)
