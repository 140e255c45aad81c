"""The producer side of the ring (the SGLang plugin, TP rank 0): maps a builder's ring and writes
requests' rows and completions (see :mod:`hs_dataset.capture.transport`)."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np
import torch

from hs_dataset.capture.transport.format import (_FAILED, _H_ATTACHED, _H_BEAT, _H_CAP, _H_DATA, _H_MAGIC, _H_SLOTS,
                                                 _H_TOKEN, _HEADER_BYTES, _MAGIC, _RESERVED, _S_CONSUMED, _S_ENCODING,
                                                 _S_ERRLEN, _S_HIDDEN, _S_MESSAGE, _S_NONFINITE, _S_NSTATES, _S_OFFSET,
                                                 _S_ROWS, _S_SEQ, _S_STATE, _S_TEACHER, _S_TOKENS, _S_WINDOW,
                                                 _SLOT_BYTES, ENCODINGS, ENV, POLL_MAX_S, RING_PREFIX, SlotInfo, _get,
                                                 _locked_by_someone, _map, _put)
from hs_dataset.codec.state_stats import add_stats
from hs_dataset.errors import RequestError, TransportError

__all__ = ["RingWriter"]

class RingWriter:
    """The producer side: maps a consumer's ring and writes requests' rows and completions."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, token: str):
        self.path, self._fd, self.mm, self.token = path, fd, mm, token
        self.data_offset = _get(mm, _H_DATA)
        self.capacity = _get(mm, _H_CAP)
        self.n_slots = _get(mm, _H_SLOTS)
        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)  # the whole file, for copies into it
        self.dead = False  # the producer found the consumer gone
        self.pending = 0  # passes whose copies into this ring are not complete yet (the producer's count)

    @classmethod
    def open(cls, directory: str | os.PathLike, token: str) -> "RingWriter":
        path = Path(directory) / f"{RING_PREFIX}{token}"
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise TransportError(f"no ring {path}: the builder that sent this request is gone, or the server's "
                                 f"{ENV} names another folder than the builder's ring_dir") from None
        try:
            size = os.fstat(fd).st_size
            mm = _map(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if _get(mm, _H_MAGIC) != _MAGIC or _get(mm, _H_TOKEN).rstrip(b"\0").decode() != token:
            mm.close()
            os.close(fd)
            raise TransportError(f"{path} is not an hs_dataset ring of token {token}")
        w = cls(path, fd, mm, token)
        _put(mm, _H_ATTACHED, os.getpid())
        return w

    def slot(self, seq: int) -> SlotInfo:
        """The reserved slot of ``seq``; :class:`RequestError` when the consumer reserved none."""
        base = _HEADER_BYTES + (seq % self.n_slots) * _SLOT_BYTES
        mm = self.mm
        if _get(mm, _S_STATE, base) != _RESERVED or _get(mm, _S_SEQ, base) != seq:
            raise RequestError(f"request seq {seq} has no reserved slot in {self.path}")
        return SlotInfo(seq, _get(mm, _S_OFFSET, base), _get(mm, _S_TOKENS, base), _get(mm, _S_NSTATES, base),
                        _get(mm, _S_HIDDEN, base), _get(mm, _S_ENCODING, base), _get(mm, _S_WINDOW, base),
                        _get(mm, _S_TEACHER, base))

    def wait_room(self, info: SlotInfo, upto: int, timeout: float = 600.0) -> None:
        """Block until positions up to ``upto`` can be written: for a windowed region, until the
        consumer is done with the rows they replace (``consumed >= upto - window``); at once otherwise.

        This is the backpressure of a sample larger than the ring: the producer (the SGLang scheduler)
        waits for the builder to write the previous rows. Raises :class:`RequestError` when the slot
        was given away (the request was abandoned) and :class:`TransportError` when the consumer is
        gone or made no room for ``timeout`` seconds.
        """
        need = upto - info.rows
        if need <= 0:
            return
        base = _HEADER_BYTES + (info.seq % self.n_slots) * _SLOT_BYTES
        deadline = time.monotonic() + timeout
        check_at = time.monotonic() + 1.0
        sleep = 0.0002
        while _get(self.mm, _S_CONSUMED, base) < need:
            if _get(self.mm, _S_SEQ, base) != info.seq or _get(self.mm, _S_STATE, base) != _RESERVED:
                raise RequestError(f"request seq {info.seq} was abandoned by the builder")
            now = time.monotonic()
            if now > check_at:
                check_at = now + 1.0
                if not self.owner_alive():
                    self.dead = True
                    raise TransportError(f"the builder of ring {self.path} is gone")
            if now > deadline:
                raise TransportError(f"the builder made no room in its ring for request seq {info.seq} for "
                                     f"{timeout:.0f} s (it stopped reading)")
            time.sleep(sleep)
            sleep = min(sleep * 2, POLL_MAX_S)

    def state_view(self, info: SlotInfo, j: int, start: int, n: int) -> torch.Tensor:
        """Positions ``[start, start + n)`` of state ``j`` in the ring: bf16 or uint8 ``[n, H]``, contiguous
        (within the window: see :meth:`SlotInfo.pieces`)."""
        a = self.data_offset + info.state_offset(j, start)
        if info.encoding == ENCODINGS["bfloat16"]:
            return self.bytes[a:a + n * info.hidden * 2].view(torch.bfloat16).view(n, info.hidden)
        return self.bytes[a:a + n * info.hidden].view(n, info.hidden)

    def teacher_views(self, info: SlotInfo, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions ``[start, start + n)`` of the teacher: ids int32 ``[n, k]``, log-probs float32 ``[n, k]``,
        logsumexp float32 ``[n]`` (within the window, as :meth:`state_view`)."""
        k = info.teacher_k
        a, b, c = (self.data_offset + o for o in info.teacher_offsets(start))
        return (self.bytes[a:a + n * k * 4].view(torch.int32).view(n, k),
                self.bytes[b:b + n * k * 4].view(torch.float32).view(n, k), self.bytes[c:c + n * 4].view(torch.float32))

    def scale_view(self, info: SlotInfo, j: int, start: int, n: int) -> torch.Tensor:
        a = self.data_offset + info.scale_offset(j, start)
        return self.bytes[a:a + n * 4].view(torch.float32)

    def complete(self, seq: int, rows: int, nonfinite: "list[int] | tuple[int, ...] | np.ndarray",
                 stats: np.ndarray | None = None) -> None:
        """A chunk of ``rows`` rows of ``seq`` is in the ring (its copy finished): add its NaN/Inf counts and
        its value statistics (float64 ``[n_states, 5]``, :func:`hs_dataset.codec.state_stats.span_stats` of
        the chunk), rows last. Plain Python and NumPy on a few values of the mapping, which keep the GIL (see
        :func:`~hs_dataset.codec.state_stats.span_stats` for why that matters in SGLang's scheduler process)."""
        base = _HEADER_BYTES + (seq % self.n_slots) * _SLOT_BYTES
        mm = self.mm
        if _get(mm, _S_SEQ, base) != seq:
            return  # the consumer gave the slot away (the request was abandoned)
        if stats is not None:
            try:
                info = self.slot(seq)
            except RequestError:
                return  # failed: its rows and statistics are not read
            a = self.data_offset + info.stats_offset()
            add_stats(np.frombuffer(mm, dtype=np.float64, count=info.stats_bytes // 8, offset=a).reshape(
                info.n_states, -1), np.asarray(stats))
        for j, k in enumerate(nonfinite):
            if k:
                f = (_S_NONFINITE + 4 * j, "<I")
                _put(mm, f, _get(mm, f, base) + int(k), base)
        _put(mm, _S_ROWS, _get(mm, _S_ROWS, base) + rows, base)

    def fail(self, seq: int, message: str) -> None:
        """Tell the consumer why ``seq`` cannot be captured."""
        base = _HEADER_BYTES + (seq % self.n_slots) * _SLOT_BYTES
        if _get(self.mm, _S_SEQ, base) != seq:
            return
        data = message.encode()[:_SLOT_BYTES - _S_MESSAGE]
        self.mm[base + _S_MESSAGE:base + _S_MESSAGE + len(data)] = data
        _put(self.mm, _S_ERRLEN, len(data), base)
        _put(self.mm, _S_STATE, _FAILED, base)

    def beat(self) -> None:
        _put(self.mm, _H_BEAT, (_get(self.mm, _H_BEAT) + 1) & (2**64 - 1))

    def owner_alive(self) -> bool:
        """Whether the consumer that created the ring still holds it."""
        return _locked_by_someone(self._fd)

    def close(self) -> None:
        self.bytes = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass
        os.close(self._fd)
