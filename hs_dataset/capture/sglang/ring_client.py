"""The SGLang backend's capture over the ring, the same for its own engine and an attached server.

A sample is submitted once its region of the ring is reserved: at most ``max_inflight`` samples and
``ring_bytes`` of states are in flight. A reader thread waits for each request while the consumer
(the builder) encodes and writes the previous rows, so the GPU's prefill and the shard writing
overlap; results come in input order as views of the ring, reused once nothing references them.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import queue
import threading
import time
import urllib.error
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from hs_dataset.capture.base import BackendItem
from hs_dataset.capture.transport import ENCODINGS, Lease, Ring, region_bytes
from hs_dataset.codec.state_stats import FIELDS as STAT_FIELDS
from hs_dataset.errors import BackendError, RequestError, TransportError
from hs_dataset.layout import StorageDtype
from hs_dataset.model_info import ModelInfo
from hs_dataset.records import CaptureResult, Reject, TokenizedSample

__all__ = ["RID_PREFIX", "RingClient"]

RID_PREFIX = "hsds-"  # capture requests' ids start with it: the plugin captures only those


class _Ended(Exception):
    """The request of a sample in pieces ended (failed) before all its positions arrived."""


@dataclass
class _Pieces:
    """A sample in pieces in flight (longer than a row): handed to the consumer, which reads its pieces itself."""

    sample: TokenizedSample
    lease: Lease
    fut: cf.Future
    row_tokens: int


class RingClient:
    """Capture through a ring: what :class:`~hs_dataset.capture.sglang.backend.SGLangBackend` sets up
    (the ring, the server reached by ``_submit``, its liveness check ``_alive``) is used here."""

    info: ModelInfo
    layers: tuple[int, ...]
    ring: Ring | None
    max_inflight: int
    prefetch: int
    request_timeout: float
    encodings: tuple[StorageDtype, ...]

    def _submit(self, rid: str, ids: list[int], params: dict | None = None) -> cf.Future:
        raise NotImplementedError

    def _alive(self) -> None:
        raise NotImplementedError

    def _wait(self, fut: cf.Future) -> dict:
        deadline = time.monotonic() + self.request_timeout
        while True:
            try:
                return fut.result(timeout=1.0)
            except cf.TimeoutError:
                self._alive()
                if time.monotonic() > deadline:
                    raise BackendError(f"an SGLang request made no progress for {self.request_timeout:.0f}s; "
                                       "the engine hangs. Rerun the same command to resume.") from None


    def window_rows(self, row_tokens: int) -> int | None:
        """Rows of a windowed region for pieces of ``row_tokens``: the longest prefill chunk of a
        request plus three pieces (the one arriving, the one being written out, and one more the
        consumer may still reference while it asks for the next); None when the engine runs each
        request in one pass (no chunked prefill: a sample must fit the ring whole)."""
        chunk = (getattr(self, "manifest", None) or {}).get("chunked_prefill_size")
        if not chunk:
            return None
        return (-(-int(chunk) // row_tokens) + 3) * row_tokens

    def _check_window(self, row_tokens: int, max_tokens: int | None, n_states: int, encoding: str,
                      teacher_k: int = 0) -> int | None:
        """The window for samples larger than half the ring, or None when the ring cannot hold one (then
        every sample must fit whole); raises up front when ``max_tokens`` needs a window and none fits.

        A window must fit in half of what the ring has beside one row: the consumer may still reference
        the last row it wrote (of the sample before) when the windowed sample starts, and that region may
        sit anywhere in the ring.
        """
        ring = self.ring
        assert ring is not None
        hidden, enc = self.info.hidden_size, ENCODINGS[encoding]
        window = self.window_rows(row_tokens)
        room = (ring.capacity - region_bytes(row_tokens, n_states, hidden, enc, teacher_k)) // 2
        fits = window is not None and region_bytes(window, n_states, hidden, enc, teacher_k) <= room
        if max_tokens is None or region_bytes(max_tokens, n_states, hidden, enc, teacher_k) <= ring.capacity // 2 or fits:
            return window if fits else None
        need = f"a sample of max_length {max_tokens} tokens ({n_states} states x {hidden}) needs more than half the " \
               f"ring ({ring.capacity / 2**30:.2f} GiB) whole"
        if window is None:
            raise BackendError(f"{need}, and the engine computes each request in one pass (no chunked prefill), so "
                               "its states cannot pass through in pieces: raise backend_options.ring_bytes, or start "
                               "the engine with chunked prefill (backend_options.chunked_prefill_size)")
        wbytes = region_bytes(window, n_states, hidden, enc, teacher_k)
        ring_needed = 2 * wbytes + ring.capacity - 2 * room
        raise BackendError(f"{need}, and one window of {window} rows ({wbytes / 2**30:.2f} GiB: the engine's prefill "
                           f"chunk + 3 rows of row_tokens {row_tokens}) needs a ring of {ring_needed / 2**30:.2f} GiB: "
                           "raise backend_options.ring_bytes, or lower row_tokens or backend_options.chunked_prefill_size")

    in_pieces = True  # start_capture passes row_tokens and max_tokens
    teachers = True  # start_capture passes teacher_k (the plugin computes the top-k on the GPU)
    without_final = True  # start_capture passes final=False for a build that does not store hidden_final

    def capture(self, samples: Iterable[TokenizedSample], *, encoding: str = "bfloat16", row_tokens: int | None = None,
                max_tokens: int | None = None, teacher_k: int = 0, final: bool = True) -> Iterator[BackendItem]:
        """Submit samples and yield results in input order, states as views of the ring.

        ``encoding``: ``bfloat16`` or ``fp8_e4m3`` (quantized on the GPU; ``CaptureResult.scales``
        holds the per-token scales). A sample is submitted once its region of the ring is
        reserved: at most ``max_inflight`` samples and ``ring_bytes`` of states are in flight. A
        reader thread waits for each request while this generator's consumer (the builder) encodes
        and writes the previous rows, so the GPU's prefill and the shard writing overlap.

        A sample longer than ``row_tokens`` comes as pieces of ``row_tokens`` positions, in order, each as
        soon as the engine's chunked prefill has computed it (the consumer writes the first rows while the
        rest is computed). One whose states would take over half the ring is not held whole: it gets a
        *windowed* region (:meth:`window_rows`), the engine waiting while the consumer writes a piece out,
        so memory stays at one window whatever the sample's length; such a sample starts alone (the ring
        drains first), samples after it are submitted as usual. Without ``row_tokens`` every sample must
        fit the ring whole (one result per sample). ``max_tokens`` (the build's max_length): checked up front
        against the ring (:class:`BackendError` naming the option when neither a whole sample nor a
        window fits). ``teacher_k``: the plugin also computes the teacher's top-k of every position
        (:mod:`hs_dataset.codec.teacher`), handed out in ``CaptureResult.teacher``. ``final=False``: the ring
        carries no final state (``CaptureResult.states`` is ``[len(layers), T, H]``; the plugin still computes
        the teacher from it): a quarter less to scan, copy and hold at Kimi width, for a build that stores the
        teacher instead of ``hidden_final``.
        """
        if encoding not in self.encodings:
            raise ValueError(f"encoding {encoding!r}: the sglang backend delivers {', '.join(self.encodings)}")
        ring = self.ring
        assert ring is not None
        n_states, hidden = len(self.layers) + int(final), self.info.hidden_size
        window = None if row_tokens is None else self._check_window(row_tokens, max_tokens, n_states, encoding,
                                                                    teacher_k)
        it = iter(samples)
        submitted: queue.Queue = queue.Queue()
        ready: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        reader = threading.Thread(target=self._read_loop, args=(submitted, ready, stop, encoding),
                                  name="hs_dataset-ring-reader", daemon=True)
        reader.start()
        inflight = 0
        waiting: TokenizedSample | None = None  # the next sample, whose region did not fit yet
        exhausted = False
        try:
            while True:
                while not exhausted and inflight < self.max_inflight:
                    s = waiting if waiting is not None else next(it, None)
                    waiting = None
                    if s is None:
                        exhausted = True
                        break
                    # windowed: a sample that would take over half the ring whole (the ring is allocated once:
                    # holding a smaller sample whole costs nothing, and it is batched with the others)
                    windowed = window is not None and s.num_tokens > window and \
                        region_bytes(s.num_tokens, n_states, hidden, ENCODINGS[encoding], teacher_k) > ring.capacity // 2
                    if s.num_tokens == 0:
                        submitted.put((s, None, Reject(s.sample_id, "input_ids", "no tokens to run", "capture")))
                    elif not windowed and not ring.fits(s.num_tokens, n_states, hidden, encoding, teacher_k):
                        submitted.put((s, None, Reject(
                            s.sample_id, "input_ids", f"{s.num_tokens} tokens of {n_states} states need more than the "
                            f"ring's {ring.capacity / 2**30:.2f} GiB: raise backend_options.ring_bytes", "capture")))
                    else:
                        if windowed and inflight > 0:
                            waiting = s  # a windowed sample starts alone: the engine may wait on it, nothing before it
                            break
                        # a sample longer than a row comes in pieces, so its first rows are written while the rest
                        # is computed (through a window of the ring when it is that long)
                        in_pieces = row_tokens is not None and s.num_tokens > row_tokens
                        lease = ring.reserve(s.num_tokens, n_states, hidden, encoding,
                                             window=window if windowed else None, pieces=in_pieces,
                                             teacher_k=teacher_k)
                        if lease is None:
                            waiting = s  # the ring is full: hand out results first
                            break
                        fut = self._submit(ring.rid(lease, RID_PREFIX), s.input_ids.tolist())
                        submitted.put((s, lease, _Pieces(s, lease, fut, int(row_tokens or 0)) if in_pieces else fut))
                    inflight += 1
                if inflight == 0:
                    if waiting is None:
                        return
                    gc.collect()  # results kept only by reference cycles
                    if ring.reclaim() == 0:
                        raise BackendError(
                            f"the shared-memory ring ({ring.capacity / 2**30:.2f} GiB) is full of results the "
                            "consumer still references: drop them (or copy what you keep) before asking for more, "
                            "or raise backend_options.ring_bytes")
                    continue
                item = ready.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, _Pieces):
                    yield from self._pieces(item)
                else:
                    yield item
                inflight -= 1
        finally:
            stop.set()
            submitted.put(None)
            while reader.is_alive():  # unblock a reader waiting to put a result
                try:
                    ready.get(timeout=0.1)
                except queue.Empty:
                    pass

    def _read_loop(self, submitted: queue.Queue, ready: queue.Queue, stop: threading.Event, encoding: str) -> None:
        while True:
            job = submitted.get()
            if job is None or stop.is_set():
                while job is not None:  # cancel what was submitted but will not be read
                    fut = job[2].fut if isinstance(job[2], _Pieces) else job[2]
                    if isinstance(fut, cf.Future):
                        fut.cancel()
                    if job[1] is not None and self.ring is not None:
                        self.ring.abandon(job[1])
                    job = submitted.get()
                return
            try:
                s, lease, fut = job
                item: BackendItem | _Pieces | BaseException = \
                    fut if lease is None or isinstance(fut, _Pieces) else self._finish(s, lease, fut)
            except BaseException as e:  # handed to the consumer, which raises it
                item = e
            ready.put(item)
            if isinstance(item, BaseException):
                return

    def _pieces(self, w: "_Pieces") -> Iterator[BackendItem]:
        """A long sample's states, piece by piece as they arrive (on the consumer's thread: for a windowed
        region the engine waits for room while the consumer writes the previous piece out), then its outcome."""
        ring = self.ring
        assert ring is not None
        s, lease, T = w.sample, w.lease, w.sample.num_tokens

        def alive() -> None:
            self._alive()
            if w.fut.done() and w.fut.exception() is not None:
                raise _Ended()

        for a in range(0, T, w.row_tokens):
            b = min(a + w.row_tokens, T)
            try:
                ring.wait(lease, self.request_timeout, alive, rows=b)
            except _Ended:
                ring.abandon(lease)
                reject = self._outcome(s, lease, w.fut)
                assert reject is not None
                yield reject
                return
            except RequestError as e:
                yield Reject(s.sample_id, "input_ids", str(e), "capture")
                return
            except TransportError as e:
                ring.abandon(lease)
                raise BackendError(f"{e}. The build stopped; rerun the same command to resume.") from None
            if ring.attached_pid:
                ring.unlink()
            states, scales = ring.views(lease, a, b)
            # the producer's NaN/Inf counts cover every position so far: all zero says this piece is clean
            seen = ring.nonfinite(lease)
            yield CaptureResult(sample=s, layers=self.layers, states=states, scales=scales, token_start=a,
                                teacher=ring.teacher(lease, a, b) if lease.info.teacher_k else None,
                                nonfinite=seen if not any(seen) else None,
                                value_stats=_counted(ring, lease) if b == T else  # the whole sample's, on its last piece
                                torch.zeros((lease.info.n_states, len(STAT_FIELDS)), dtype=torch.float64))
            del states, scales
        reject = self._outcome(s, lease, w.fut)
        if reject is not None:  # every position arrived, but the request ended badly: the sample is rejected
            yield reject

    def _outcome(self, s: TokenizedSample, lease: Lease, fut: cf.Future) -> Reject | None:
        """Wait for the request itself: None when it finished, else the sample's :class:`Reject`
        (the region is then abandoned). A failure of the engine raises :class:`BackendError`."""
        ring = self.ring
        assert ring is not None
        try:
            out = self._wait(fut)
        except BackendError:
            ring.abandon(lease)
            raise
        except urllib.error.HTTPError as e:
            ring.abandon(lease)
            return Reject(s.sample_id, "input_ids", f"SGLang refused the request: {e.read()[:500]!r}", "capture")
        except (ValueError, RuntimeError) as e:  # request-level errors (e.g. too long for the context)
            ring.abandon(lease)
            self._alive()
            return Reject(s.sample_id, "input_ids", f"SGLang refused the request: {e}", "capture")
        except Exception as e:
            ring.abandon(lease)
            raise BackendError(f"SGLang request failed: {type(e).__name__}: {e}") from e
        out = out[0] if isinstance(out, list) else out
        finish = (out.get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            ring.abandon(lease)
            return Reject(s.sample_id, "input_ids", f"SGLang aborted the request: {finish.get('message')}", "capture")
        return None

    def _finish(self, s: TokenizedSample, lease: Lease, fut: cf.Future) -> BackendItem:
        """Wait for one request and return views of its states in the ring (or say why it is rejected)."""
        ring = self.ring
        assert ring is not None
        reject = self._outcome(s, lease, fut)
        if reject is not None:
            return reject
        try:
            ring.wait(lease, self.request_timeout, self._alive)
        except RequestError as e:
            return Reject(s.sample_id, "input_ids", str(e), "capture")
        except TransportError as e:
            ring.abandon(lease)
            raise BackendError(f"{e}. The build stopped; rerun the same command to resume.") from None
        if ring.attached_pid:
            ring.unlink()  # attach mode: the server mapped the ring on this first request
        states, scales = ring.views(lease)
        return CaptureResult(sample=s, layers=self.layers, states=states, scales=scales,
                             teacher=ring.teacher(lease) if lease.info.teacher_k else None,
                             nonfinite=ring.nonfinite(lease), value_stats=_counted(ring, lease))


def _counted(ring: Ring, lease: Lease) -> torch.Tensor:
    """The statistics the producer counted over every position of the request (checked: all of them)."""
    counted = ring.value_stats(lease)
    values = lease.info.num_tokens * lease.info.hidden
    if not bool((counted[:, 0] == values).all()):
        raise BackendError(f"the capture plugin counted {counted[:, 0].tolist()} values per state for request seq "
                           f"{lease.seq}, which stores {values:,}: the SGLang server runs another hs_dataset version "
                           "than this build (install the same one on both sides)")
    return counted
