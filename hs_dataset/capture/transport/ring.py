"""The consumer side of the ring (the builder): creates it, reserves regions, waits for requests,
hands out views (see :mod:`hs_dataset.capture.transport`)."""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import torch

from hs_dataset.capture.transport.format import (_ALIGN, _DATA_ALIGN, _FAILED, _FREE, _H_ATTACHED, _H_BEAT, _H_CAP,
                                                 _H_CREATOR, _H_DATA, _H_MAGIC, _H_SLOTS, _H_TOKEN, _HEADER_BYTES,
                                                 _MAGIC, _MAX_STATES, _RESERVED, _S_CONSUMED, _S_ENCODING, _S_ERRLEN,
                                                 _S_HIDDEN, _S_MESSAGE, _S_NONFINITE, _S_NSTATES, _S_OFFSET, _S_ROWS,
                                                 _S_SEQ, _S_STATE, _S_TEACHER, _S_TOKENS, _S_WINDOW, _SLOT_BYTES, ENCODINGS,
                                                 POLL_MAX_S, RING_PREFIX, STALE_AFTER_S, SlotInfo, _align, _get, _map,
                                                 _put, make_rid, region_bytes)
from hs_dataset.capture.transport.regions import FreeList, Lease, _use_count
from hs_dataset.errors import RequestError, TransportError

__all__ = ["Lease", "Ring"]  # Lease: hs_dataset.capture.transport.regions


class Ring:
    """The consumer side: creates the ring, reserves regions, waits for requests, hands out views.

    Thread-safe: the backend reserves on its submitting thread and waits on its reader thread.
    """

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, token: str, n_slots: int, data_offset: int,
                 capacity: int):
        self.path, self._fd, self._mm, self.token = path, fd, mm, token
        self.n_slots, self.data_offset, self.capacity = n_slots, data_offset, capacity
        self._regions = FreeList(capacity)
        self._leases: dict[int, Lease] = {}
        self._next_seq = 0
        self._unlinked = False
        self._lock = threading.Lock()

    @classmethod
    def create(cls, directory: str | os.PathLike, capacity: int, *, n_slots: int = 1024,
               option: str = "backend_options.ring_bytes") -> "Ring":
        """Create, fully allocate and map a ring of ``capacity`` data bytes in ``directory``.

        Raises :class:`TransportError` naming the size needed and ``option`` when the folder's
        file system (``/dev/shm``) has no room for it.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex[:12]
        data_offset = _align(_HEADER_BYTES + n_slots * _SLOT_BYTES, _DATA_ALIGN)
        capacity = _align(int(capacity), _ALIGN)
        size = data_offset + capacity
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
        need = f"the shared-memory ring needs {size / 2**30:.2f} GiB in {directory}"
        fix = (f"set {option} smaller (it bounds the samples in flight), or give {directory} more room "
               "(docker: --shm-size)")
        if free < size:
            raise TransportError(f"{need}, which has {free / 2**30:.2f} GiB free: {fix}")
        path = directory / f"{RING_PREFIX}{token}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for the ring's life: tells the producer we are alive
            try:
                os.posix_fallocate(fd, 0, size)  # every page exists now: no SIGBUS later, no fault on the hot path
            except OSError as e:
                raise TransportError(f"{need} and could not get it ({os.strerror(e.errno or 0)}): {fix}") from None
            mm = _map(fd, size)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        _put(mm, _H_MAGIC, _MAGIC)
        _put(mm, _H_TOKEN, token.encode())
        _put(mm, _H_DATA, data_offset)
        _put(mm, _H_CAP, capacity)
        _put(mm, _H_SLOTS, n_slots)
        _put(mm, _H_CREATOR, os.getpid())
        return cls(path, fd, mm, token, n_slots, data_offset, capacity)

    # -- state the producer writes ------------------------------------------------------------------
    @property
    def attached_pid(self) -> int:
        """The producer's pid once it has mapped the ring (0 before)."""
        return _get(self._mm, _H_ATTACHED)

    def _beat(self) -> int:
        return _get(self._mm, _H_BEAT)

    def unlink(self) -> None:
        """Delete the ring's file (both mappings stay valid): after this a crash leaves nothing behind."""
        if not self._unlinked:
            self.path.unlink(missing_ok=True)
            self._unlinked = True

    # -- regions ------------------------------------------------------------------------------------
    def _slot(self, seq: int) -> int:
        return _HEADER_BYTES + (seq % self.n_slots) * _SLOT_BYTES

    def _drop(self, lease: Lease) -> None:
        _put(self._mm, _S_STATE, _FREE, self._slot(lease.seq))
        self._regions.release(lease.offset, lease.nbytes)
        del self._leases[lease.seq]

    def reclaim(self) -> int:
        """Free the regions whose views nobody references any more; returns how many."""
        with self._lock:
            return self._reclaim()

    def _reclaim(self) -> int:
        done = [le for le in self._leases.values()
                if le.base is not None and not le.abandoned and _use_count(le.base) <= 2]
        for le in done:
            le.base = None
            self._drop(le)
        for le in [le for le in self._leases.values() if le.in_pieces and not le.abandoned]:
            self._release_pieces(le)
            if le.consumed >= le.info.num_tokens:
                self._drop(le)
                done.append(le)
        return len(done)

    def _release_pieces(self, lease: Lease) -> None:
        """Release the pieces nobody references, in order (a windowed region's producer may write their rows again)."""
        while lease.pieces and _use_count(lease.pieces[0][1]) <= 2:
            lease.consumed = lease.pieces.pop(0)[0]
            _put(self._mm, _S_CONSUMED, lease.consumed, self._slot(lease.seq))

    def fits(self, num_tokens: int, n_states: int, hidden: int, encoding: str, teacher_k: int = 0) -> bool:
        """Whether a whole region of this size can ever fit (the ring's capacity, ignoring what is in use)."""
        return _align(region_bytes(num_tokens, n_states, hidden, ENCODINGS[encoding], teacher_k), _ALIGN) <= self.capacity

    def reserve(self, num_tokens: int, n_states: int, hidden: int, encoding: str, *,
                window: int | None = None, pieces: bool = False, teacher_k: int = 0) -> Lease | None:
        """Reserve a region and a slot for a new request; None while the ring is too full.

        ``window``: a windowed region of that many rows (when fewer than ``num_tokens``): the request's
        states then pass through it piece by piece (:meth:`views` of ``[start, stop)``, released once
        unreferenced), the producer waiting for room (see :class:`SlotInfo`). ``pieces``: a whole region
        handed out the same way (so that the consumer writes a long sample's rows while the rest arrives).
        ``teacher_k``: the producer also writes the teacher's top-k of every position (:meth:`teacher`).
        """
        if n_states > _MAX_STATES:
            raise TransportError(f"{n_states} states per token; the ring carries at most {_MAX_STATES}")
        enc = ENCODINGS[encoding]
        rows = num_tokens if window is None else min(int(window), num_tokens)
        nbytes = region_bytes(rows, n_states, hidden, enc, teacher_k)
        with self._lock:
            offset = self._regions.alloc(nbytes)
            if offset is None:
                self._reclaim()
                offset = self._regions.alloc(nbytes)
                if offset is None:
                    return None
            busy = {s % self.n_slots for s in self._leases}
            for _ in range(self.n_slots):  # a slot still held by an earlier request is skipped
                seq = self._next_seq
                self._next_seq += 1
                if seq % self.n_slots not in busy:
                    break
            else:
                self._regions.release(offset, nbytes)
                return None
            lease = Lease(seq, offset, nbytes, SlotInfo(seq, offset, num_tokens, n_states, hidden, enc,
                                                        rows if rows < num_tokens else 0, teacher_k))
            lease.in_pieces = pieces or lease.info.windowed
            self._leases[seq] = lease
        base = self._slot(seq)
        mm = self._mm
        mm[base:base + _S_MESSAGE] = bytes(_S_MESSAGE)
        _put(mm, _S_SEQ, seq, base)
        _put(mm, _S_TOKENS, num_tokens, base)
        _put(mm, _S_OFFSET, offset, base)
        _put(mm, _S_NSTATES, n_states, base)
        _put(mm, _S_HIDDEN, hidden, base)
        _put(mm, _S_ENCODING, enc, base)
        _put(mm, _S_WINDOW, lease.info.window, base)
        _put(mm, _S_TEACHER, teacher_k, base)
        a = self.data_offset + lease.info.stats_offset()
        mm[a:a + lease.info.stats_bytes] = bytes(lease.info.stats_bytes)  # the producer adds each pass's to these
        _put(mm, _S_STATE, _RESERVED, base)  # last: the slot is valid
        return lease

    def rid(self, lease: Lease, prefix: str) -> str:
        """The id of the request that fills ``lease`` (:func:`~hs_dataset.capture.transport.format.make_rid`)."""
        return make_rid(prefix, self.token, lease.seq, lease.info.teacher_k)

    def in_use(self) -> int:
        """Bytes of regions reserved, in flight or still referenced."""
        with self._lock:
            return self.capacity - self._regions.free_bytes()

    def poll(self, lease: Lease) -> tuple[int, str | None]:
        """(rows done, the producer's failure message or None)."""
        base = self._slot(lease.seq)
        if _get(self._mm, _S_STATE, base) == _FAILED:
            n = _get(self._mm, _S_ERRLEN, base)
            msg = bytes(self._mm[base + _S_MESSAGE:base + _S_MESSAGE + n]).decode("utf-8", "replace")
            return _get(self._mm, _S_ROWS, base), msg
        return _get(self._mm, _S_ROWS, base), None

    def wait(self, lease: Lease, timeout: float, alive: Callable[[], None] | None = None, *,
             stale_after: float = STALE_AFTER_S, rows: int | None = None) -> None:
        """Block until every row of ``lease`` (or its first ``rows`` positions) has arrived.

        Raises :class:`RequestError` (the producer failed this request), or :class:`TransportError`
        after ``timeout`` s without a new row or when the producer stopped beating. ``alive()`` is
        called about every 0.1 s and should raise if the engine died. A windowed region's
        unreferenced pieces are released to the producer while waiting.
        """
        T = lease.info.num_tokens if rows is None else rows
        rows, msg = self.poll(lease)
        if rows >= T and msg is None:
            return
        now = time.monotonic()
        deadline, next_alive, sleep = now + timeout, now + 0.1, 0.0002
        beat, beat_at = self._beat(), now
        while True:
            rows_now, msg = self.poll(lease)
            if msg is not None:
                self.fail_release(lease)
                raise RequestError(msg)
            if rows_now >= T:
                return
            now = time.monotonic()
            if rows_now != rows:
                rows, deadline, sleep = rows_now, now + timeout, 0.0002
            b = self._beat()
            if b != beat:
                beat, beat_at = b, now
            elif self.attached_pid and now - beat_at > stale_after:
                raise TransportError(f"the SGLang capture plugin (pid {self.attached_pid}) stopped: no heartbeat "
                                     f"in the ring {self.path} for {now - beat_at:.0f} s (the server died or hangs)")
            if now > deadline:
                raise TransportError(f"no hidden states for request seq {lease.seq} at position {rows} of {T} "
                                     f"after {timeout:.0f} s (ring {self.path})")
            if lease.in_pieces:  # the consumer dropped a piece: a windowed region's producer may write its rows again
                with self._lock:
                    self._release_pieces(lease)
            if alive is not None and now > next_alive:
                alive()
                next_alive = now + 0.1
            time.sleep(sleep)
            sleep = min(sleep * 2, POLL_MAX_S)

    def nonfinite(self, lease: Lease) -> tuple[int, ...]:
        """Per state, the positions holding NaN/Inf (counted by the producer on the GPU)."""
        base = self._slot(lease.seq) + _S_NONFINITE
        return struct.unpack_from(f"<{lease.info.n_states}I", self._mm, base)

    def value_stats(self, lease: Lease) -> torch.Tensor:
        """The statistics of the request's stored values (float64 ``[n_states, 5]``,
        :mod:`hs_dataset.codec.state_stats`), added up by the producer over every position that arrived."""
        i = lease.info
        a = self.data_offset + i.stats_offset()
        return torch.frombuffer(bytearray(self._mm[a:a + i.stats_bytes]), dtype=torch.float64).view(i.n_states, -1)

    def views(self, lease: Lease, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The request's states at positions ``[start, stop)`` (bf16 ``[n, k, H]`` or fp8 bits
        ``uint8 [n, k, H]``) and, for fp8, their float32 scales ``[n, k]``, as views of the ring.

        A whole region (default: all positions, once the request finished) is reused once neither
        these nor anything made from them (numpy arrays, Arrow buffers) is referenced. A windowed
        region hands out its positions in order, one piece within the window at a time (wait for
        ``rows=stop`` first); the producer may write a piece's rows again once it is unreferenced.
        """
        i = lease.info
        stop = i.num_tokens if stop is None else stop
        a = self.data_offset + lease.offset
        # Through a memoryview: the tensor keeps it, and it keeps the mapping exported, so close()
        # cannot unmap the ring under a live view (torch.frombuffer alone keeps no buffer export).
        base = torch.frombuffer(memoryview(self._mm)[a:a + lease.nbytes], dtype=torch.uint8)
        R = i.rows
        if lease.in_pieces:
            if not 0 <= start < stop <= i.num_tokens or stop - start > R or (start % R) + (stop - start) > R \
                    or start != (lease.pieces[-1][0] if lease.pieces else lease.consumed):
                raise ValueError(f"positions {start}..{stop} of request seq {lease.seq}: a region in pieces hands out "
                                 f"its positions in order, within its {R} rows")
        elif (start, stop) != (0, i.num_tokens):
            raise ValueError("a whole region hands out all its positions at once (reserve it with pieces=True)")
        lo = start % R  # a windowed region wraps; a whole one holds position p at row p
        hi = lo + stop - start
        if i.encoding == ENCODINGS["bfloat16"]:
            states, scales = base[:i.n_states * R * i.hidden * 2].view(torch.bfloat16).view(i.n_states, R, i.hidden)[
                :, lo:hi], None
        else:
            states = base[:i.n_states * R * i.hidden].view(i.n_states, R, i.hidden)[:, lo:hi]
            at = i.scale_offset(0) - i.offset
            scales = base[at:at + i.n_states * R * 4].view(torch.float32).view(i.n_states, R)[:, lo:hi]
        with self._lock:  # reclaimable from now on, and the views above already count as references
            if lease.in_pieces:
                self._release_pieces(lease)
                lease.pieces.append((stop, base))
            else:
                lease.base = base
        return states, scales

    def teacher(self, lease: Lease, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       torch.Tensor]:
        """The teacher's top-k of the positions :meth:`views` last handed out (call it right after): ids int32
        ``[n, k]``, log-probs float32 ``[n, k]``, logsumexp float32 ``[n]``, views of the same bytes (so the
        region is reused only once these too are unreferenced)."""
        i = lease.info
        stop = i.num_tokens if stop is None else stop
        base = lease.pieces[-1][1] if lease.in_pieces else lease.base
        if base is None or not i.teacher_k:
            raise ValueError(f"request seq {lease.seq}: no teacher (reserved with teacher_k=0) or no views handed out")
        n, k = stop - start, i.teacher_k
        a, b, c = (o - i.offset for o in i.teacher_offsets(start))
        return (base[a:a + n * k * 4].view(torch.int32).view(n, k), base[b:b + n * k * 4].view(torch.float32).view(n, k),
                base[c:c + n * 4].view(torch.float32))

    def fail_release(self, lease: Lease) -> None:
        """The producer is done with a failed request: its region is free again (a windowed one's
        once the pieces handed out are unreferenced)."""
        with self._lock:
            if lease.seq in self._leases and lease.base is None:
                if lease.pieces:
                    lease.abandoned = True  # pieces still referenced: kept until close
                else:
                    self._drop(lease)

    def abandon(self, lease: Lease) -> None:
        """A request that ended without its states: keep its region until close (chunks may still come)."""
        lease.abandoned = True

    def close(self) -> None:
        """Delete the file and drop the mapping (at once, or when the last view is freed)."""
        self.unlink()
        with self._lock:
            for le in self._leases.values():
                le.base = None
            self._leases.clear()
        try:
            self._mm.close()
        except BufferError:
            pass  # views still exist: the mapping goes with the last of them
        self._mm = None  # type: ignore[assignment]
        if self._fd >= 0:
            os.close(self._fd)  # releases the lock
            self._fd = -1
