"""Child processes (a capture backend's, the tokenize workers): how one ended, in words, and dying with the
parent that started it."""

from __future__ import annotations

import ctypes
import os
import signal

__all__ = ["describe_exit", "set_parent_death_signal"]


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
