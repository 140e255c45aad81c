"""Processes and signals: how a child process (a capture backend's, the tokenize workers) ended, in words; dying
with the parent that started it; Ctrl-C and SIGTERM never lost.

Ctrl-C and SIGTERM that are never lost: a stop asked for inside native code is acted on at our next row.

Python runs a signal handler between bytecodes of the main thread, wherever it is. A ``KeyboardInterrupt``
raised while native code is calling back into Python (pyarrow reading an extension type's metadata inside
``datasets``' builder, say) can be caught and printed there, and the build then goes on to exit 0 as if no
signal had come. So while a part is generated (:func:`interrupts_deferred`), the command line's handler only
notes the request (:func:`interrupt_or_defer`), and the build raises ``KeyboardInterrupt`` itself at the
next row or part boundary (:func:`check_interrupt`), in its own code. A second signal raises at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from multiprocessing import resource_tracker
from typing import Any, Iterator

__all__ = ["check_interrupt", "describe_exit", "interrupt_or_defer", "interrupts_deferred", "set_parent_death_signal",
           "settle_resource_tracker"]


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


_requested = threading.Event()
_deferring = [0]  # nesting depth of interrupts_deferred() (the main thread's)


def interrupt_or_defer() -> None:
    """From a SIGINT/SIGTERM handler: raise ``KeyboardInterrupt`` now, or, inside :func:`interrupts_deferred`,
    note the request for :func:`check_interrupt` (a second request raises at once).

    Raises:
        KeyboardInterrupt: outside :func:`interrupts_deferred`, or on a second request.
    """
    if _deferring[0] and not _requested.is_set():
        _requested.set()
        return
    _requested.clear()
    raise KeyboardInterrupt


def check_interrupt() -> None:
    """Raise the ``KeyboardInterrupt`` a signal asked for while deferred (nothing when none was).

    Raises:
        KeyboardInterrupt: a stop was asked for.
    """
    if _requested.is_set():
        _requested.clear()
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """While the block runs, a signal handled by :func:`interrupt_or_defer` is noted, not raised."""
    _deferring[0] += 1
    try:
        yield
    finally:
        _deferring[0] -= 1
