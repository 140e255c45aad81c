"""Content checksums of shards: what a build records for each shard, and the checks against it.

Every shard entry (in its part record and in ``hs_dataset.json`` under ``shards``) holds::

    {"name": "train-00003-000.arrow", "bytes": 2147483648, "rows": 18,
     "xxh3_128": "<hex of the whole file>", "edges_xxh3_128": "<hex of its first and last MiB>",
     "block_bytes": 1048576, "blocks_xxh3_64": "<16 hex digits per block of block_bytes, in order>"}

The whole-file hash is what ``verify``, ``push`` and the Hub compare; the block hashes (format version 2 on)
are what every reader checks as it reads (:mod:`hs_dataset.read.shard_checks`): a block's bytes are hashed
when a row's values in it are first read in a pass, so nothing read is served unchecked, and no verdict is
kept between passes. A 1 MiB block costs a reader at most two partial blocks of extra hashing per value, and a
build 16 hex digits per MiB in its manifest (16 MB per TB).

The hash is xxh3-128 (``xxhash``, a dependency of ``datasets``): several times faster on one core than
sha256 or blake2b, a few percent of writing a row where they cost a third or more (``benchmarks/checksum.py``).
It guards against faults (bit
flips, zeroed blocks, truncation, a stale copy), not against an attacker; the Hub's own LFS sha256
covers transfers.

Two checks of one shard against its entry:

* **quick** (:func:`check_shard` with ``quick=True``, what a resumed build runs on every recorded
  part): the size, the hash of the first and last MiB, and the row count read from the file's own
  framing (Arrow IPC message headers / the Parquet footer). It reads 2 MiB plus the headers of a
  shard, so it catches truncation, deletion, torn or zeroed edges and broken framing, but not a
  flipped bit in the middle of a shard larger than 2 MiB;
* **full** (``quick=False``, what ``hs-dataset verify`` and ``push`` run): the hash of every byte (whole and
  per block: an entry whose block hashes disagree with its whole hash is refused), and the row count.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

__all__ = ["BLOCK_BYTES", "BLOCKS_KEY", "BLOCK_SIZE_KEY", "EDGE_BYTES", "HASH_KEY", "EDGES_KEY", "block_digest",
           "check_shard", "edges_digest", "file_digest", "file_digests", "shard_entry", "shard_rows"]

HASH_KEY = "xxh3_128"
EDGES_KEY = "edges_xxh3_128"
BLOCKS_KEY = "blocks_xxh3_64"
BLOCK_SIZE_KEY = "block_bytes"
BLOCK_BYTES = 1 << 20
DIGITS = 16  # hex digits of one block's xxh3-64
EDGE_BYTES = 1 << 20
_CHUNK = 1 << 20


def block_digest(data: Any) -> str:
    """xxh3-64 hex digest (16 digits) of one block (any bytes-like object)."""
    return xxhash.xxh3_64_hexdigest(data)


def file_digests(path: str | os.PathLike, block: int = BLOCK_BYTES) -> tuple[str, str]:
    """A file's xxh3-128 and its ``block``-byte blocks' xxh3-64 (concatenated hex), in one read."""
    h = xxhash.xxh3_128()
    blocks: list[str] = []
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = 0
            while n < block and (k := f.readinto(view[n:])):
                n += k
            if not n:
                break
            h.update(view[:n])
            blocks.append(block_digest(view[:n]))
            if n < block:
                break
    return h.hexdigest(), "".join(blocks)


def file_digest(path: str | os.PathLike) -> str:
    """xxh3-128 hex digest of a whole file."""
    return file_digests(path)[0]


def edges_digest(path: str | os.PathLike, size: int | None = None) -> str:
    """xxh3-128 hex digest of a file's first and last :data:`EDGE_BYTES` (the whole file when smaller)."""
    size = os.path.getsize(path) if size is None else size
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        if size <= 2 * EDGE_BYTES:
            h.update(f.read())
        else:
            h.update(f.read(EDGE_BYTES))
            f.seek(size - EDGE_BYTES)
            h.update(f.read(EDGE_BYTES))
    return h.hexdigest()


def shard_rows(path: str | os.PathLike) -> int:
    """Rows in a shard, from its framing only: the Arrow IPC stream's batch headers (memory-mapped,
    bodies not read) or the Parquet footer. Raises ``OSError``/``pyarrow.ArrowInvalid`` if broken."""

    if str(path).endswith(".parquet"):

        return int(pq.ParquetFile(str(path)).metadata.num_rows)
    rows = 0
    with pa.memory_map(str(path)) as src:
        reader = pa.ipc.open_stream(src)
        for batch in reader:
            rows += batch.num_rows
    return rows


def shard_entry(path: str | os.PathLike, digest: str | None = None, *, rows: int | None = None) -> dict[str, Any]:
    """The entry recorded for a shard just written (``digest``: its xxh3-128, ``rows``: its rows, when already
    known)."""
    p = Path(path)
    size = p.stat().st_size
    whole, blocks = file_digests(p)  # read back once: the writer hashed the whole file, not its blocks
    return {"name": p.name, "bytes": size, "rows": shard_rows(p) if rows is None else int(rows),
            HASH_KEY: digest or whole, EDGES_KEY: edges_digest(p, size), BLOCK_SIZE_KEY: BLOCK_BYTES,
            BLOCKS_KEY: blocks}


def check_shard(path: str | os.PathLike, entry: dict[str, Any], *, quick: bool, digest: str | None = None) -> str | None:
    """Why the shard at ``path`` does not match its recorded ``entry`` (None: it matches).

    Args:
        path: the shard file.
        entry: its record (see the module docstring).
        quick: size + first/last MiB + row count; else size + full hash + row count.
        digest: the file's xxh3-128 when the caller already computed it (push hashes every file once).
    """
    p = Path(path)
    if not p.is_file():
        return "is missing"
    size = p.stat().st_size
    if size != int(entry["bytes"]):
        return f"has {size} bytes, {entry['bytes']} recorded (truncated or replaced)"
    if HASH_KEY not in entry or EDGES_KEY not in entry:
        return "has no recorded checksum (written by an hs_dataset without checksums)"
    if quick:
        if edges_digest(p, size) != entry[EDGES_KEY]:
            return "its first or last MiB differs from what was written (corrupted)"
    elif BLOCKS_KEY in entry and digest is None:  # push hashed the whole file already: the part records say the rest
        whole, blocks = file_digests(p, int(entry.get(BLOCK_SIZE_KEY) or BLOCK_BYTES))
        if whole != entry[HASH_KEY]:
            return f"its content hash differs from the recorded {HASH_KEY} (corrupted since it was written)"
        if blocks != entry[BLOCKS_KEY]:
            bad = next(i for i in range(0, max(len(blocks), len(entry[BLOCKS_KEY])), DIGITS)
                       if blocks[i:i + DIGITS] != entry[BLOCKS_KEY][i:i + DIGITS]) // DIGITS
            return (f"its block {bad} differs from the recorded {BLOCKS_KEY} although its {HASH_KEY} matches "
                    "(the record was edited, or written by another build)")
    elif (digest or file_digest(p)) != entry[HASH_KEY]:
        return f"its content hash differs from the recorded {HASH_KEY} (corrupted since it was written)"
    try:
        rows = shard_rows(p)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError... for a broken file
        return f"cannot be read as a shard ({type(e).__name__}: {str(e)[:200]})"
    if rows != int(entry["rows"]):
        return f"holds {rows} rows, {entry['rows']} recorded"
    return None
