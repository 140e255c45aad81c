"""The ring's file format (header page, slot table, data area), its names, and the request ids:
what both sides of the transport read and write (see :mod:`hs_dataset.capture.transport`)."""

from __future__ import annotations

import fcntl
import mmap
import struct
from dataclasses import dataclass

from hs_dataset.codec.state_stats import FIELDS as STAT_FIELDS

__all__ = ["DEFAULT_RING_BYTES", "ENCODINGS", "ENV", "MANIFEST", "OWNER_LOCK", "PLUGIN_ERROR", "PLUGIN_STATS", "SCHEDULER_ERROR",
           "PRIVATE_DIR_PREFIX",
           "RING_PREFIX", "SlotInfo", "make_rid", "parse_rid", "region_bytes", "request_spans", "rid_teacher_k"]

ENV = "HS_DATASET_CAPTURE"  # JSON {"layers": [...], "dir": "...", "rid_prefix": "...", "ring": token?} for the plugin
MANIFEST = "plugin-manifest.json"
PLUGIN_ERROR = "plugin-error.txt"
SCHEDULER_ERROR = "scheduler-error.txt"  # the last line of an exception SGLang's scheduler logged (the plugin)
PLUGIN_STATS = "plugin-stats.json"  # the plugin's running totals (TP rank 0), rewritten at most twice a second
RING_PREFIX = "ring-"
PRIVATE_DIR_PREFIX = "hs_dataset-"  # per-backend folders in /dev/shm (in-process engines)
OWNER_LOCK = "owner.lock"

ENCODINGS = {"bfloat16": 0, "fp8_e4m3": 1}
_ENCODING_NAMES = {v: k for k, v in ENCODINGS.items()}
_MAGIC = b"HSRING02"  # 02: a region ends with its request's value statistics
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
_S_CONSUMED = (44, "<I")  # windowed regions: rows the consumer is done with (their room can be written again)
_S_NONFINITE = 48  # _MAX_STATES x u32
_S_WINDOW = (112, "<I")  # rows the region holds: num_tokens, or fewer for a windowed region (positions modulo it)
_S_TEACHER = (116, "<I")  # k of the teacher's top-k the producer computes per position (0: none)
_S_MESSAGE = 128
_FREE, _RESERVED, _FAILED = 0, 1, 2
DEFAULT_RING_BYTES = 8 << 30  # the SGLang backend's ring unless set: at most half of its folder's free room
STALE_AFTER_S = 30.0  # no producer heartbeat for this long: the producer is gone (it beats every 0.5 s)
POLL_MAX_S = 0.002  # longest sleep between looks at a slot


def _get(buf, field: tuple[int, str], base: int = 0):
    return struct.unpack_from(field[1], buf, base + field[0])[0]


def _put(buf, field: tuple[int, str], value, base: int = 0) -> None:
    struct.pack_into(field[1], buf, base + field[0], value)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _state_bytes(rows: int, n_states: int, hidden: int, encoding: int) -> int:
    if encoding == ENCODINGS["bfloat16"]:
        return n_states * rows * hidden * 2
    return _align(n_states * rows * hidden, 16) + n_states * rows * 4


_STATS_FIELDS = len(STAT_FIELDS)  # float64 per state


def _teacher_bytes(rows: int, teacher_k: int) -> int:
    return _align(rows * (teacher_k * 8 + 4), 16) if teacher_k else 0


def region_bytes(num_tokens: int, n_states: int, hidden: int, encoding: int, teacher_k: int = 0) -> int:
    """Bytes of one request's region: the states, for fp8 their per-token scales, with a teacher its
    top-``teacher_k`` ids (int32) and log-probs (float32) and the logsumexp (float32) of every position, and
    last the request's value statistics (float64 per state, :mod:`hs_dataset.codec.state_stats`)."""
    base = _align(_state_bytes(num_tokens, n_states, hidden, encoding), 16)
    return base + _teacher_bytes(num_tokens, teacher_k) + n_states * _STATS_FIELDS * 8


def make_rid(prefix: str, token: str, seq: int, teacher_k: int = 0) -> str:
    """A request's id: ``<prefix><token>-<seq>``, and ``-k<teacher_k>`` when it asks for the teacher's top-k (every
    TP rank reads that from the batch: with the output embedding split over ranks, each computes its part)."""
    return f"{prefix}{token}-{seq}" + (f"-k{teacher_k}" if teacher_k else "")


def _rid_parts(rid: str, prefix: str) -> tuple[str, int, int] | None:
    if not rid.startswith(prefix):
        return None
    body, k = rid[len(prefix):], 0
    head, sep, tail = body.rpartition("-k")
    if sep and tail.isdigit() and "-" in head:
        body, k = head, int(tail)
    token, sep, seq = body.rpartition("-")
    if not sep or not seq.isdigit():
        return None
    return token, int(seq), k


def parse_rid(rid: str, prefix: str) -> tuple[str, int] | None:
    """:func:`make_rid`'s id -> (token, seq); None for a request that is not ours."""
    parts = _rid_parts(rid, prefix)
    return None if parts is None else parts[:2]


def rid_teacher_k(rid: str, prefix: str) -> int:
    """The teacher's ``k`` a request of ours asks for in its id (:func:`make_rid`); 0 for none or not ours."""
    parts = _rid_parts(rid, prefix)
    return 0 if parts is None else parts[2]


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
    """What a request's slot says about its region (offsets relative to the data area).

    ``window``: the rows the region holds. A *whole* region holds every position (``window ==
    num_tokens``); a *windowed* one (a sample larger than the ring can hold) holds ``window`` rows,
    position ``p`` at row ``p % window``: the producer writes rows ``[p, p + n)`` only once the consumer
    is done with the rows that were there (``consumed >= p + n - window``).
    """

    seq: int
    offset: int
    num_tokens: int
    n_states: int
    hidden: int
    encoding: int
    window: int = 0  # 0: whole (num_tokens)
    teacher_k: int = 0

    @property
    def rows(self) -> int:
        """Rows of the region: ``window``, or ``num_tokens`` for a whole region."""
        return self.window or self.num_tokens

    @property
    def windowed(self) -> bool:
        return self.rows < self.num_tokens

    def state_offset(self, j: int, start: int = 0) -> int:
        """Where position ``start`` of state ``j`` lives (modulo the window)."""
        esize = 2 if self.encoding == ENCODINGS["bfloat16"] else 1
        return self.offset + (j * self.rows + start % self.rows) * self.hidden * esize

    def scale_offset(self, j: int, start: int = 0) -> int:
        return self.offset + _align(self.n_states * self.rows * self.hidden, 16) + (j * self.rows + start % self.rows) * 4

    def teacher_offsets(self, start: int = 0) -> tuple[int, int, int]:
        """Where position ``start`` (modulo the window) of the teacher's ids, log-probs and logsumexp live."""
        base = self.offset + _align(_state_bytes(self.rows, self.n_states, self.hidden, self.encoding), 16)
        p, k = start % self.rows, self.teacher_k
        return (base + p * k * 4, base + self.rows * k * 4 + p * k * 4, base + 2 * self.rows * k * 4 + p * 4)

    def stats_offset(self) -> int:
        """Where the request's value statistics live: float64 ``[n_states, 5]``, added up over its passes."""
        return (self.offset + _align(_state_bytes(self.rows, self.n_states, self.hidden, self.encoding), 16)
                + _teacher_bytes(self.rows, self.teacher_k))

    @property
    def stats_bytes(self) -> int:
        return self.n_states * _STATS_FIELDS * 8

    def pieces(self, start: int, n: int) -> list[tuple[int, int]]:
        """Positions ``[start, start + n)`` as ``(position, length)`` pieces that do not wrap the window."""
        out = []
        while n > 0:
            k = min(n, self.rows - start % self.rows)
            out.append((start, k))
            start, n = start + k, n - k
        return out


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
