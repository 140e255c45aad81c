"""The build's progress display: one bar for the build stage, plain lines in a log, nothing when off.

* On a terminal (stderr is a tty): one tqdm bar (samples, tokens/s, bytes written, ETA), created at the
  first written row, so whatever a backend prints while it starts (an engine's weight-loading bar)
  comes before it instead of through it.
* Elsewhere (a log file, a pipe): one plain line per committed part, without carriage returns or
  escape codes.
* ``enabled=False`` (``--no-progress``): nothing.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm.auto import tqdm

__all__ = ["BuildProgress", "is_terminal"]


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default stderr) is an interactive terminal."""
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class BuildProgress:
    """Progress of one build (see the module docstring).

    Args:
        total: samples of the build; done: samples of parts already built (a resumed build).
        enabled: False shows nothing.
        parts_total, parts_done: the build's parts, and those already built.
        stream: where to write (default stderr).
    """

    def __init__(self, total: int, done: int, enabled: bool, *, parts_total: int = 0, parts_done: int = 0,
                 stream: TextIO | None = None):
        self.total, self.done, self.done_at_start = total, done, done
        self.enabled = enabled
        self.parts_total, self.parts_done = parts_total, parts_done
        self.stream = stream or sys.stderr
        self.terminal = is_terminal(self.stream)
        self.t0 = time.time()
        self.tokens = 0
        self.bytes = 0
        self.bar: tqdm | None = None

    def _rate(self) -> str:
        return f"{self.tokens / max(time.time() - self.t0, 1e-9):,.0f} tok/s, {self.bytes / 2**30:.2f} GiB written"

    def row(self, tokens: int, nbytes: int) -> None:
        """One row written: ``tokens`` tokens, ``nbytes`` bytes of states."""
        self.tokens += tokens
        self.bytes += nbytes
        self.done += 1
        if not (self.enabled and self.terminal):
            return
        if self.bar is None:
            self.bar = tqdm(total=self.total, initial=self.done - 1, unit="sample", dynamic_ncols=True,
                            desc="hs-dataset build", file=self.stream)
        self.bar.set_postfix_str(self._rate(), refresh=False)
        self.bar.update(1)

    def part_done(self) -> None:
        """One part committed (a log gets a line)."""
        self.parts_done += 1
        if self.enabled and not self.terminal:
            dt = time.time() - self.t0
            new = self.done - self.done_at_start
            eta = f", ETA {_duration(dt / new * (self.total - self.done))}" if new and self.total > self.done else ""
            print(f"hs-dataset build: part {self.parts_done} of {self.parts_total} committed, {self.done}/{self.total} "
                  f"samples captured, {self._rate()}, {_duration(dt)} elapsed{eta}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
