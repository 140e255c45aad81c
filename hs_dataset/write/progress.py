"""Progress displays: one bar on a terminal, plain lines in a log, nothing when off; for the build
(:class:`BuildProgress`) and for the rows a plan tokenizes (:class:`RowProgress`).

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
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from tqdm.auto import tqdm

__all__ = ["BuildProgress", "RowProgress", "is_terminal"]


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
            from tqdm.auto import tqdm  # deferred: the command line starts without it

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


class RowProgress:
    """Rows read and tokenized (``hs-dataset plan``): on a terminal a bar (rows, tokens/s, ETA); in a log a
    line at every tenth of the rows; nothing when ``enabled`` is False.

    Args:
        total: rows to read. enabled: False shows nothing. desc: the bar's label.
        stream: where to write (default stderr).
    """

    def __init__(self, total: int, enabled: bool, *, desc: str = "hs-dataset plan", stream: TextIO | None = None):
        self.total, self.done, self.tokens = total, 0, 0
        self.enabled, self.desc = enabled and total > 0, desc
        self.stream = stream or sys.stderr
        self.terminal = is_terminal(self.stream)
        self.t0 = self.t_first = time.time()
        self.bar: tqdm | None = None
        self._next_line = 1

    def row(self, tokens: int) -> None:
        """One row read: ``tokens`` tokens (0: rejected)."""
        if self.done == 0:  # the rate and the ETA from the first row on (not the tokenizer's start)
            self.t_first = time.time()
        self.done += 1
        self.tokens += tokens
        if not self.enabled:
            return
        since = max(time.time() - self.t_first, 1e-9)
        rate = f"{self.tokens / since:,.0f} tok/s"
        if self.terminal:
            if self.bar is None:
                from tqdm.auto import tqdm  # deferred: the command line starts without it

                self.bar = tqdm(total=self.total, unit="row", dynamic_ncols=True, desc=self.desc, file=self.stream,
                                leave=False)
            self.bar.set_postfix_str(rate, refresh=False)
            self.bar.update(1)
        elif self.done * 10 >= self._next_line * self.total:
            self._next_line = self.done * 10 // self.total + 1
            dt = time.time() - self.t0
            eta = f", ETA {_duration(since / self.done * (self.total - self.done))}" if self.done < self.total else ""
            print(f"{self.desc}: {self.done:,}/{self.total:,} rows tokenized, {self.tokens:,} tokens, {rate}, "
                  f"{_duration(dt)} elapsed{eta}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
