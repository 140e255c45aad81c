"""The tokenize stage in worker processes: the chat template, the tokenizer and the loss mask run in
parallel, and the results come back in row order, never more than a few chunks ahead.

A slow tokenizer (Kimi-K2.5's is Python over ``tiktoken``) tokenizes some 10-40 thousand tokens per
second per core, below what one engine prefills; :class:`TokenizeWorkers` runs
:func:`~hs_dataset.prepare.rows.prepare_row` (parse, tokenize, mask) in ``processes`` processes,
each with its own copy of the tokenizer, loaded from the same directory and checked to be the same
(class, size, chat template). Rows go out in chunks of :data:`CHUNK_ROWS`; at most
:data:`CHUNKS_PER_WORKER` chunks per worker are in flight, so memory stays bounded and the consumer
(the capture, ``plan``) always finds the next results ready while it works on the current ones.
The results are those of the serial path, in the same order, rejects included: the same function on
the same tokenizer, one row at a time, consumed in submission order.

The workers are started at once, by the thread that makes the pool (``spawn``: nothing of the
build's process is inherited, no forked locks or threads), ignore Ctrl-C and SIGTERM (the build's
process handles them and stops the pool) and die with the process that started them (a SIGKILLed
build leaves no worker behind). A worker that dies stops the build with one line
(:class:`~hs_dataset.errors.TokenizeWorkerError`); a rerun resumes.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import signal
from collections import deque
from concurrent.futures.process import BrokenProcessPool
from itertools import islice
from typing import Any, Iterable, Iterator

from hs_dataset.errors import ConfigError, TokenizeWorkerError
from hs_dataset.prepare.rows import TokenizeRules, prepare_row
from hs_dataset.prepare.tokenizer import chat_template_sha256, load_tokenizer
from hs_dataset.processes import set_parent_death_signal
from hs_dataset.records import Reject, SourceRow, TokenizedSample

__all__ = ["AUTO_MAX_WORKERS", "AUTO_MIN_ROWS", "CHUNKS_PER_WORKER", "CHUNK_ROWS", "TokenizeWorkers",
           "tokenize_processes", "tokenizer_identity"]

CHUNK_ROWS = 8  # rows per task: small enough that the first results come at once, large enough to amortize the pipe
CHUNKS_PER_WORKER = 3  # chunks in flight per worker: one being tokenized, the next ones queued
AUTO_MAX_WORKERS = 8  # the default's cap: beyond it the engine, not the tokenizer, is the bottleneck
AUTO_MIN_ROWS = 1024  # below this a worker's start (seconds: importing transformers, loading the tokenizer) costs more

_worker: dict[str, Any] = {}  # in a worker process: its tokenizer, or the error loading it


def tokenize_processes(setting: int | None, rows: int) -> int:
    """Worker processes for ``tokenize_workers=setting`` and a build of ``rows`` rows (0: none, tokenize here).

    ``None`` (the default): one per CPU core this process may use, at most :data:`AUTO_MAX_WORKERS`, for
    a build of at least :data:`AUTO_MIN_ROWS` rows on at least 2 cores; else 0.
    """
    if setting is not None:
        return max(0, int(setting))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return min(cores, AUTO_MAX_WORKERS) if cores >= 2 and rows >= AUTO_MIN_ROWS else 0


def tokenizer_identity(tokenizer: Any) -> tuple[str, int, str]:
    """What a worker's tokenizer must share with the build's: class, size, chat template hash."""
    return type(tokenizer).__name__, len(tokenizer), chat_template_sha256(tokenizer)


def _start_worker(parent: int, path: str, trust_remote_code: bool) -> None:
    """A worker's initializer: signals, death with the parent, the tokenizer (an error is kept for the first task)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the build's process handles Ctrl-C and stops the workers
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ... and SIGTERM (Slurm sends it to every process of a job)
    set_parent_death_signal(parent)
    try:
        _worker["tokenizer"] = load_tokenizer(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - handed to the build's process by the first task
        _worker["error"] = ConfigError(f"a tokenize worker cannot load the tokenizer at {path!r}: {e}")


def _identity() -> tuple[str, int, str]:
    if "error" in _worker:
        raise _worker["error"]
    return tokenizer_identity(_worker["tokenizer"])


def _prepare_chunk(rows: list[SourceRow], rules: TokenizeRules) -> list[tuple[int, TokenizedSample | Reject]]:
    if "error" in _worker:
        raise _worker["error"]
    tokenizer = _worker["tokenizer"]
    return [(row.index, prepare_row(row, tokenizer, rules)) for row in rows]


def _died() -> TokenizeWorkerError:
    return TokenizeWorkerError(
        "a tokenize worker process died (killed, e.g. by the out-of-memory killer: see `dmesg`, or a crash in the "
        "tokenizer); run the same command again to resume, or set tokenize_workers=0 to tokenize in the build's "
        "own process")


class TokenizeWorkers:
    """``processes`` worker processes that prepare source rows, results in row order (see the module docstring).

    Args:
        processes: how many (at least 1).
        tokenizer_path: the tokenizer's directory, as the build loaded it.
        trust_remote_code: as the build loaded it.
        identity: the build's tokenizer's :func:`tokenizer_identity`: every worker's must equal it.

    The workers start at once; :meth:`prepare` raises, before any row, :class:`ConfigError` when one cannot
    load the tokenizer or loads a different one, :class:`~hs_dataset.errors.TokenizeWorkerError` when one died.
    """

    def __init__(self, processes: int, tokenizer_path: str | os.PathLike[str], *, trust_remote_code: bool,
                 identity: tuple[str, int, str]):
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.processes = processes
        self._path = os.fspath(tokenizer_path)
        self._identity = identity
        self._pool = cf.ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn"), initializer=_start_worker,
                                            initargs=(os.getpid(), self._path, trust_remote_code))
        # One task per worker: each submit starts one process, from this thread (its death signal is tied to
        # the thread that started it); the answers, each worker's tokenizer, are checked before the first
        # rows go out, so the workers start while the build loads the model.
        self._checks: list[cf.Future] | None = [self._pool.submit(_identity) for _ in range(processes)]

    def _check(self) -> None:
        if self._checks is None:
            return
        checks, self._checks = self._checks, None
        for check in checks:
            got = self._result(check)
            if got != self._identity:
                raise ConfigError(f"a tokenize worker loaded another tokenizer from {self._path!r} ({got}) than the "
                                  f"build did ({self._identity}): did the directory change? Rerun, or set "
                                  "tokenize_workers=0")

    def _result(self, future: cf.Future) -> Any:
        try:
            return future.result()
        except BrokenProcessPool:
            raise _died() from None

    def prepare(self, rows: Iterable[SourceRow], rules: TokenizeRules) -> Iterator[tuple[int, TokenizedSample | Reject]]:
        """``(row index, sample or reject)`` of every row, in the order of ``rows``
        (:func:`~hs_dataset.prepare.rows.prepare_row` in the workers).

        Raises:
            ConfigError: a worker cannot load the tokenizer, or loaded another one.
            TokenizeWorkerError: a worker died.
        """
        self._check()
        it = iter(rows)
        pending: deque[cf.Future] = deque()

        def submit() -> bool:
            chunk = list(islice(it, CHUNK_ROWS))
            if chunk:
                try:
                    pending.append(self._pool.submit(_prepare_chunk, chunk, rules))
                except BrokenProcessPool:  # a worker died while nothing of ours was running
                    raise _died() from None
            return bool(chunk)

        try:
            while len(pending) < self.processes * CHUNKS_PER_WORKER and submit():
                pass
            while pending:
                results = self._result(pending.popleft())
                submit()
                yield from results
        finally:
            for f in pending:  # the consumer stopped early: what was not started is dropped
                f.cancel()

    def close(self) -> None:
        """Stop the workers (chunks being tokenized finish; queued ones are dropped)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "TokenizeWorkers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
