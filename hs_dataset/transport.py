"""The transport stage: captured states from the SGLang plugin (TP rank 0) to the builder through
one shared-memory ring per build, written by the GPU and read in place.

The builder (the *consumer*) creates the ring: one file ``<dir>/ring-<token>`` (``/dev/shm`` by
default), all of its pages allocated up front (``posix_fallocate``: a ``/dev/shm`` too small is
refused here, naming the size and the option), mapped once. The SGLang plugin (the *producer*)
maps the same file and registers it as pinned host memory (``cudaHostRegister``), so its
device-to-host copies land in it directly at PCIe speed; the builder wraps the bytes as tensors
and Arrow buffers without a copy. No file is created per chunk and no page is allocated on the
hot path.

File layout: a header page, a slot table, the data area. The consumer does all allocation:

1. before submitting a request it *reserves* a region of the data area big enough for the whole
   request (``[n_states, T, H]`` bf16, or fp8 bits ``[n_states, T, H]`` + float32 scales
   ``[n_states, T]``) and fills the request's slot (seq, offset, T, states, encoding); the request
   id names the ring and the seq (``<prefix><token>-<seq>``, :func:`parse_rid`);
2. the producer copies every prefill chunk of the request to its rows ``[start, start + n)`` of
   each state, and once the copy has completed on the GPU adds the chunk's NaN/Inf counts and, last,
   its rows to the slot (or marks the slot failed, with a message);
3. the consumer waits for ``rows == T``, hands out views of the region, and reuses the region once
   nothing references those views any more (the tensor storage's use count; nothing is freed
   early, nothing copied out). A request that ended without its states (aborted, timed out) keeps
   its region until the ring is closed, since its chunks might still arrive.

Backpressure is the ring's capacity: a request is submitted only when its region is reserved.

Faults: the producer beats a counter in the header twice a second; a consumer waiting on a ring
whose producer stopped beating raises :class:`TransportError`. The consumer holds an exclusive
``flock`` on the ring file for its whole life; the producer tests that lock and drops the rings
of dead consumers, and :func:`remove_stale` (run when a backend starts) deletes ring files and
private ring folders whose owner is gone. The consumer deletes the ring file as soon as the
producer has mapped it, so a crash leaves nothing in ``/dev/shm``.

Memory order: slot fields are plain aligned stores into shared memory, the rows count last; this
relies on a TSO machine (x86-64), where stores become visible in program order.

Only numpy-free, torch-only code: the plugin imports this module in SGLang's scheduler process.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .errors import RequestError, TransportError

__all__ = [
    "ENCODINGS", "ENV", "MANIFEST", "PLUGIN_ERROR", "PLUGIN_STATS", "Lease", "RequestError", "Ring",
    "RingWriter", "SlotInfo", "TransportError", "parse_rid", "remove_stale", "request_spans",
]

ENV = "HS_DATASET_CAPTURE"  # JSON {"layers": [...], "dir": "...", "rid_prefix": "...", "ring": token?} for the plugin
MANIFEST = "plugin-manifest.json"
PLUGIN_ERROR = "plugin-error.txt"
PLUGIN_STATS = "plugin-stats.json"  # the plugin's running totals (TP rank 0), rewritten at most twice a second
RING_PREFIX = "ring-"
PRIVATE_DIR_PREFIX = "hs_dataset-"  # per-backend folders in /dev/shm (in-process engines)
OWNER_LOCK = "owner.lock"

ENCODINGS = {"bfloat16": 0, "fp8_e4m3": 1}
_ENCODING_NAMES = {v: k for k, v in ENCODINGS.items()}
_MAGIC = b"HSRING01"
_HEADER_BYTES = 4096
_SLOT_BYTES = 512
_MAX_STATES = 16
_ALIGN = 4096  # region alignment: page-aligned rows for the DMA engine and for Arrow
_DATA_ALIGN = 2 << 20
# header fields: (offset, struct format)
_H_MAGIC, _H_TOKEN, _H_DATA, _H_CAP, _H_SLOTS = (0, "8s"), (16, "16s"), (32, "<Q"), (40, "<Q"), (48, "<I")
_H_CREATOR, _H_ATTACHED, _H_BEAT = (56, "<Q"), (64, "<Q"), (72, "<Q")
# slot fields
_S_SEQ, _S_STATE, _S_TOKENS, _S_OFFSET = (0, "<Q"), (8, "<I"), (12, "<I"), (16, "<Q")
_S_NSTATES, _S_HIDDEN, _S_ENCODING, _S_ROWS, _S_ERRLEN = (24, "<I"), (28, "<I"), (32, "<I"), (36, "<I"), (40, "<I")
_S_NONFINITE = 48  # _MAX_STATES x u32
_S_MESSAGE = 128
_FREE, _RESERVED, _FAILED = 0, 1, 2
STALE_AFTER_S = 30.0  # no producer heartbeat for this long: the producer is gone (it beats every 0.5 s)
POLL_MAX_S = 0.002  # longest sleep between looks at a slot


def _get(buf, field: tuple[int, str], base: int = 0):
    return struct.unpack_from(field[1], buf, base + field[0])[0]


def _put(buf, field: tuple[int, str], value, base: int = 0) -> None:
    struct.pack_into(field[1], buf, base + field[0], value)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def region_bytes(num_tokens: int, n_states: int, hidden: int, encoding: int) -> int:
    """Bytes of one request's region: the states, and for fp8 their per-token scales."""
    if encoding == ENCODINGS["bfloat16"]:
        return n_states * num_tokens * hidden * 2
    return _align(n_states * num_tokens * hidden, 16) + n_states * num_tokens * 4


def parse_rid(rid: str, prefix: str) -> tuple[str, int] | None:
    """``<prefix><token>-<seq>`` -> (token, seq); None for a request that is not ours."""
    if not rid.startswith(prefix):
        return None
    token, sep, seq = rid[len(prefix):].rpartition("-")
    if not sep or not seq.isdigit():
        return None
    return token, int(seq)


def request_spans(rids: list[str], extend_lens: list[int], prefix_lens: list[int],
                  rid_prefix: str) -> list[tuple[str, int, int, int]]:
    """Split a batched prefill into our requests: ``(rid, row_offset, start_position, length)``.

    Rows of a batched EXTEND pass are the requests' new tokens back to back, in batch order;
    ``start_position`` is the request's prefix length (tokens computed in earlier passes).
    Requests whose id does not start with ``rid_prefix`` are not ours and are skipped.
    """
    out = []
    off = 0
    for rid, n, p in zip(rids, extend_lens, prefix_lens):
        if rid.startswith(rid_prefix) and n > 0:
            out.append((rid, off, int(p), int(n)))
        off += int(n)
    return out


@dataclass(frozen=True)
class SlotInfo:
    """What a request's slot says about its region (offsets relative to the data area)."""

    seq: int
    offset: int
    num_tokens: int
    n_states: int
    hidden: int
    encoding: int

    def state_offset(self, j: int, start: int = 0) -> int:
        esize = 2 if self.encoding == ENCODINGS["bfloat16"] else 1
        return self.offset + (j * self.num_tokens + start) * self.hidden * esize

    def scale_offset(self, j: int, start: int = 0) -> int:
        return self.offset + _align(self.n_states * self.num_tokens * self.hidden, 16) + (j * self.num_tokens + start) * 4


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                     prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _locked_by_someone(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@dataclass
class Lease:
    """A request's reserved region, from reservation until nothing references its views."""

    seq: int
    offset: int
    nbytes: int
    info: SlotInfo
    base: torch.Tensor | None = None  # the region's bytes, once handed out
    abandoned: bool = False


class Ring:
    """The consumer side: creates the ring, reserves regions, waits for requests, hands out views.

    Thread-safe: the backend reserves on its submitting thread and waits on its reader thread.
    """

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, token: str, n_slots: int, data_offset: int,
                 capacity: int):
        self.path, self._fd, self._mm, self.token = path, fd, mm, token
        self.n_slots, self.data_offset, self.capacity = n_slots, data_offset, capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (start, size), coalesced
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
    def _alloc(self, nbytes: int) -> int | None:
        size = _align(max(nbytes, 1), _ALIGN)
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, free - size)
                return start
        return None

    def _release(self, offset: int, nbytes: int) -> None:
        size = _align(max(nbytes, 1), _ALIGN)
        self._free.append((offset, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged

    def _slot(self, seq: int) -> int:
        return _HEADER_BYTES + (seq % self.n_slots) * _SLOT_BYTES

    def _drop(self, lease: Lease) -> None:
        _put(self._mm, _S_STATE, _FREE, self._slot(lease.seq))
        self._release(lease.offset, lease.nbytes)
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
        return len(done)

    def fits(self, num_tokens: int, n_states: int, hidden: int, encoding: str) -> bool:
        """Whether a request of this size can ever fit (the ring's capacity, ignoring what is in use)."""
        return _align(region_bytes(num_tokens, n_states, hidden, ENCODINGS[encoding]), _ALIGN) <= self.capacity

    def reserve(self, num_tokens: int, n_states: int, hidden: int, encoding: str) -> Lease | None:
        """Reserve a region and a slot for a new request; None while the ring is too full."""
        if n_states > _MAX_STATES:
            raise TransportError(f"{n_states} states per token; the ring carries at most {_MAX_STATES}")
        enc = ENCODINGS[encoding]
        nbytes = region_bytes(num_tokens, n_states, hidden, enc)
        with self._lock:
            offset = self._alloc(nbytes)
            if offset is None:
                self._reclaim()
                offset = self._alloc(nbytes)
                if offset is None:
                    return None
            busy = {s % self.n_slots for s in self._leases}
            for _ in range(self.n_slots):  # a slot still held by an earlier request is skipped
                seq = self._next_seq
                self._next_seq += 1
                if seq % self.n_slots not in busy:
                    break
            else:
                self._release(offset, nbytes)
                return None
            lease = Lease(seq, offset, nbytes, SlotInfo(seq, offset, num_tokens, n_states, hidden, enc))
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
        _put(mm, _S_STATE, _RESERVED, base)  # last: the slot is valid
        return lease

    def rid(self, lease: Lease, prefix: str) -> str:
        return f"{prefix}{self.token}-{lease.seq}"

    def in_use(self) -> int:
        """Bytes of regions reserved, in flight or still referenced."""
        with self._lock:
            return self.capacity - sum(n for _, n in self._free)

    def poll(self, lease: Lease) -> tuple[int, str | None]:
        """(rows done, the producer's failure message or None)."""
        base = self._slot(lease.seq)
        if _get(self._mm, _S_STATE, base) == _FAILED:
            n = _get(self._mm, _S_ERRLEN, base)
            msg = bytes(self._mm[base + _S_MESSAGE:base + _S_MESSAGE + n]).decode("utf-8", "replace")
            return _get(self._mm, _S_ROWS, base), msg
        return _get(self._mm, _S_ROWS, base), None

    def wait(self, lease: Lease, timeout: float, alive: Callable[[], None] | None = None, *,
             stale_after: float = STALE_AFTER_S) -> None:
        """Block until every row of ``lease`` has arrived.

        Raises :class:`RequestError` (the producer failed this request), or :class:`TransportError`
        after ``timeout`` s without a new row or when the producer stopped beating. ``alive()`` is
        called about every 0.1 s and should raise if the engine died.
        """
        T = lease.info.num_tokens
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
            if alive is not None and now > next_alive:
                alive()
                next_alive = now + 0.1
            time.sleep(sleep)
            sleep = min(sleep * 2, POLL_MAX_S)

    def nonfinite(self, lease: Lease) -> tuple[int, ...]:
        """Per state, the positions holding NaN/Inf (counted by the producer on the GPU)."""
        base = self._slot(lease.seq) + _S_NONFINITE
        return struct.unpack_from(f"<{lease.info.n_states}I", self._mm, base)

    def views(self, lease: Lease) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The finished request's states (bf16 ``[n, T, H]`` or fp8 bits ``uint8 [n, T, H]``) and,
        for fp8, its float32 scales ``[n, T]``, as views of the ring: the region is reused once
        neither these nor anything made from them (numpy arrays, Arrow buffers) is referenced."""
        i = lease.info
        a = self.data_offset + lease.offset
        # Through a memoryview: the tensor keeps it, and it keeps the mapping exported, so close()
        # cannot unmap the ring under a live view (torch.frombuffer alone keeps no buffer export).
        base = torch.frombuffer(memoryview(self._mm)[a:a + lease.nbytes], dtype=torch.uint8)
        if i.encoding == ENCODINGS["bfloat16"]:
            states, scales = base.view(torch.bfloat16).view(i.n_states, i.num_tokens, i.hidden), None
        else:
            states = base[:i.n_states * i.num_tokens * i.hidden].view(i.n_states, i.num_tokens, i.hidden)
            start = i.scale_offset(0) - i.offset
            scales = base[start:start + i.n_states * i.num_tokens * 4].view(torch.float32)
            scales = scales.view(i.n_states, i.num_tokens)
        with self._lock:  # reclaimable from now on, and the views above already count as references
            lease.base = base
        return states, scales

    def fail_release(self, lease: Lease) -> None:
        """The producer is done with a failed request: its region is free again."""
        with self._lock:
            if lease.seq in self._leases and lease.base is None:
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
                        _get(mm, _S_HIDDEN, base), _get(mm, _S_ENCODING, base))

    def state_view(self, info: SlotInfo, j: int, start: int, n: int) -> torch.Tensor:
        """Rows ``[start, start + n)`` of state ``j`` in the ring: bf16 or uint8 ``[n, H]``, contiguous."""
        a = self.data_offset + info.state_offset(j, start)
        if info.encoding == ENCODINGS["bfloat16"]:
            return self.bytes[a:a + n * info.hidden * 2].view(torch.bfloat16).view(n, info.hidden)
        return self.bytes[a:a + n * info.hidden].view(n, info.hidden)

    def scale_view(self, info: SlotInfo, j: int, start: int, n: int) -> torch.Tensor:
        a = self.data_offset + info.scale_offset(j, start)
        return self.bytes[a:a + n * 4].view(torch.float32)

    def complete(self, seq: int, rows: int, nonfinite: list[int] | tuple[int, ...]) -> None:
        """A chunk of ``rows`` rows of ``seq`` is in the ring (its copy finished): add its counts, rows last."""
        base = _HEADER_BYTES + (seq % self.n_slots) * _SLOT_BYTES
        mm = self.mm
        if _get(mm, _S_SEQ, base) != seq:
            return  # the consumer gave the slot away (the request was abandoned)
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


MEMORY_FS = ("tmpfs", "hugetlbfs", "ramfs")


def file_system_type(path: str | os.PathLike) -> str | None:
    """The type of the file system holding ``path`` (Linux ``/proc/self/mounts``; None elsewhere)."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    target, best, kind = os.path.realpath(path), "", None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def remove_stale(directory: str | os.PathLike) -> list[str]:
    """Delete the ring files in ``directory`` and the private ring folders (``hs_dataset-*``) in it
    whose owner died (nobody holds their lock); returns what was removed."""
    removed: list[str] = []
    d = Path(directory)
    if not d.is_dir():
        return removed
    for p in d.iterdir():
        if p.name.startswith(RING_PREFIX) and p.is_file():
            lock = p
        elif p.name.startswith(PRIVATE_DIR_PREFIX) and p.is_dir():
            lock = p / OWNER_LOCK
        else:
            continue
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            if p.is_dir() and time.time() - p.stat().st_mtime > 60:  # died before taking its lock
                shutil.rmtree(p, ignore_errors=True)
                removed.append(str(p))
            continue
        try:
            if _locked_by_someone(fd):
                continue
        finally:
            os.close(fd)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(str(p))
    return removed


def private_dir(parent: str | os.PathLike) -> tuple[Path, int]:
    """A new ring folder ``<parent>/hs_dataset-<id>`` and the fd of its held owner lock."""
    d = Path(parent) / f"{PRIVATE_DIR_PREFIX}{uuid.uuid4().hex[:12]}"
    d.mkdir(parents=True)
    fd = os.open(d / OWNER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return d, fd
