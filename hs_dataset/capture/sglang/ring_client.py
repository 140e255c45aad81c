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
from typing import Iterable, Iterator

from hs_dataset.capture.base import BackendItem
from hs_dataset.capture.transport import Lease, Ring
from hs_dataset.errors import BackendError, RequestError, TransportError
from hs_dataset.layout import StorageDtype
from hs_dataset.model_info import ModelInfo
from hs_dataset.records import CaptureResult, Reject, TokenizedSample

__all__ = ["RID_PREFIX", "RingClient"]

RID_PREFIX = "hsds-"  # capture requests' ids start with it: the plugin captures only those


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


    def capture(self, samples: Iterable[TokenizedSample], *, encoding: str = "bfloat16") -> Iterator[BackendItem]:
        """Submit samples and yield results in input order, states as views of the ring.

        ``encoding``: ``bfloat16`` or ``fp8_e4m3`` (quantized on the GPU; ``CaptureResult.scales``
        holds the per-token scales). A sample is submitted once its region of the ring is
        reserved: at most ``max_inflight`` samples and ``ring_bytes`` of states are in flight. A
        reader thread waits for each request while this generator's consumer (the builder) encodes
        and writes the previous rows, so the GPU's prefill and the shard writing overlap.
        """
        if encoding not in self.encodings:
            raise ValueError(f"encoding {encoding!r}: the sglang backend delivers {', '.join(self.encodings)}")
        ring = self.ring
        assert ring is not None
        n_states, hidden = len(self.layers) + 1, self.info.hidden_size
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
                    if s.num_tokens == 0:
                        submitted.put((s, None, Reject(s.sample_id, "input_ids", "no tokens to run", "capture")))
                    elif not ring.fits(s.num_tokens, n_states, hidden, encoding):
                        submitted.put((s, None, Reject(
                            s.sample_id, "input_ids", f"{s.num_tokens} tokens of {n_states} states need more than the "
                            f"ring's {ring.capacity / 2**30:.2f} GiB: raise backend_options.ring_bytes", "capture")))
                    else:
                        lease = ring.reserve(s.num_tokens, n_states, hidden, encoding)
                        if lease is None:
                            waiting = s  # the ring is full: hand out results first
                            break
                        submitted.put((s, lease, self._submit(ring.rid(lease, RID_PREFIX), s.input_ids.tolist())))
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
                inflight -= 1
                if isinstance(item, BaseException):
                    raise item
                yield item
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
                    if isinstance(job[2], cf.Future):
                        job[2].cancel()
                    if job[1] is not None and self.ring is not None:
                        self.ring.abandon(job[1])
                    job = submitted.get()
                return
            try:
                s, lease, fut = job
                item: BackendItem | BaseException = fut if lease is None else self._finish(s, lease, fut)
            except BaseException as e:  # handed to the consumer, which raises it
                item = e
            ready.put(item)
            if isinstance(item, BaseException):
                return

    def _finish(self, s: TokenizedSample, lease: Lease, fut: cf.Future) -> BackendItem:
        """Wait for one request and return views of its states in the ring (or say why it is rejected)."""
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
                             nonfinite=ring.nonfinite(lease))

