"""Ctrl-C and SIGTERM that are never lost: a stop asked for inside native code is acted on at our next row.

Python runs a signal handler between bytecodes of the main thread, wherever it is. A ``KeyboardInterrupt``
raised while native code is calling back into Python (pyarrow reading an extension type's metadata inside
``datasets``' builder, say) can be caught and printed there, and the build then goes on to exit 0 as if no
signal had come. So while a part is generated (:func:`interrupts_deferred`), the command line's handler only
notes the request (:func:`interrupt_or_defer`), and the build raises ``KeyboardInterrupt`` itself at the
next row or part boundary (:func:`check_interrupt`), in its own code. A second signal raises at once.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["check_interrupt", "interrupt_or_defer", "interrupts_deferred"]

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
