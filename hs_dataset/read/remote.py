"""A published version streamed over HTTP, each block of a shard checked before a row of it is handed out.

``open_dataset("org/name", streaming=True)`` reads the version's Arrow shards through ``huggingface_hub``'s
``HfFileSystem`` (HTTP range reads, nothing written to disk) and hands ``datasets`` their record batches
as an ``IterableDataset`` (one ``datasets`` shard per file, so DataLoader workers and nodes split them).
The bytes pass through :class:`VerifiedFile` on their way to the Arrow reader: each ``block_bytes`` block
is hashed as it arrives and compared with the ``blocks_xxh3_64`` the version records; a block that differs
raises :class:`~hs_dataset.errors.IntegrityError` before any row that lies in it is decoded, and the rows
of a shard are handed out only from blocks already checked. A shard of a format 1 version (no block hashes)
is hashed whole as it streams and checked at its end: its rows are handed out before that check (open such
a version without ``streaming`` to have it checked before the first row). Coded versions (zstd Arrow,
Parquet) are streamed by ``datasets`` itself, unchecked (``hs-dataset verify`` checks them).
"""

from __future__ import annotations

import io
from typing import Any, Iterator

import datasets
import pyarrow as pa
import xxhash
from datasets.iterable_dataset import ArrowExamplesIterable
from huggingface_hub import HfFileSystem

from hs_dataset.errors import IntegrityError
from hs_dataset.integrity.checksums import BLOCK_BYTES, BLOCK_SIZE_KEY, BLOCKS_KEY, DIGITS, HASH_KEY, block_digest
from hs_dataset.integrity.verify import recorded_shards
from hs_dataset.layout import DATA_DIR, META_FILE
from hs_dataset.read.shard_checks import shard_checks_enabled

__all__ = ["VerifiedFile", "stream_version"]


class VerifiedFile(io.RawIOBase):
    """The bytes of ``raw`` (a file read in order), handed out only once the block holding them matched ``entry``.

    Args:
        raw: the file as it arrives (any object with ``read(n)``).
        entry: the shard's record (``bytes``, ``blocks_xxh3_64`` / ``block_bytes``, or only ``xxh3_128``).
        where: names the shard in errors.
    """

    def __init__(self, raw: Any, entry: dict[str, Any], where: str):
        super().__init__()
        self.raw, self.entry, self.where = raw, entry, where
        self.block = int(entry.get(BLOCK_SIZE_KEY) or BLOCK_BYTES)
        self.blocks = str(entry[BLOCKS_KEY]) if BLOCKS_KEY in entry else None
        self.whole = None if self.blocks is not None else xxhash.xxh3_128()
        self._buf = memoryview(b"")
        self._index = 0  # the next block to arrive
        self._total = 0

    def readable(self) -> bool:
        return True

    def _next_block(self) -> bool:
        parts, n = [], 0
        while n < self.block:
            got = self.raw.read(self.block - n)
            if not got:
                break
            parts.append(got)
            n += len(got)
        if not n:
            return False
        data = b"".join(parts)
        if self.blocks is not None:
            want = self.blocks[self._index * DIGITS:(self._index + 1) * DIGITS]
            if block_digest(data) != want:
                raise IntegrityError(f"{self.where}: block {self._index} (bytes {self._total}..{self._total + n}) "
                                     f"as streamed differs from the {BLOCKS_KEY} its {META_FILE} records (damaged on "
                                     "the Hub or on the way): none of its rows is handed out; read it again, and if it "
                                     "is refused again the published file is damaged (`hs-dataset verify` names it)")
        elif self.whole is not None:
            self.whole.update(data)
        self._index += 1
        self._total += n
        self._buf = memoryview(data)
        return True

    def readinto(self, b: Any) -> int:
        if not self._buf and not self._next_block():
            return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def read(self, size: int | None = -1) -> bytes:
        """Up to ``size`` bytes (all that is left when negative): short only at the end (Arrow needs whole reads)."""
        parts: list[bytes] = []
        want = -1 if size is None else size
        while want != 0 and (self._buf or self._next_block()):
            n = len(self._buf) if want < 0 else min(want, len(self._buf))
            parts.append(bytes(self._buf[:n]))
            self._buf = self._buf[n:]
            want = want - n if want > 0 else want
        return b"".join(parts)

    def finish(self) -> None:
        """Read what is left (past the Arrow stream's end) and check the size, and a format 1 shard's whole hash."""
        while self._next_block():
            self._buf = memoryview(b"")
        if self._total != int(self.entry["bytes"]):
            raise IntegrityError(f"{self.where}: {self._total} bytes arrived, {self.entry['bytes']} recorded")
        if self.whole is not None and HASH_KEY in self.entry and self.whole.hexdigest() != self.entry[HASH_KEY]:
            raise IntegrityError(f"{self.where}: its content hash as streamed differs from the {HASH_KEY} its "
                                 f"{META_FILE} records (damaged on the Hub or on the way)")


def _tables(shards: list[dict[str, Any]], repo_id: str, commit: str, token: str | None,
            endpoint: str | None) -> Iterator[tuple[str, pa.Table]]:
    fs = HfFileSystem(endpoint=endpoint, token=token)
    check = shard_checks_enabled()
    for s in shards:
        where = f"{repo_id}@{commit}: {DATA_DIR}/{s['name']}"
        with fs.open(f"datasets/{repo_id}@{commit}/{DATA_DIR}/{s['name']}", "rb") as raw:
            source = VerifiedFile(raw, s, where) if check else raw
            for i, batch in enumerate(pa.ipc.open_stream(source)):
                yield f"{s['name']}:{i}", pa.Table.from_batches([batch])
            if isinstance(source, VerifiedFile):
                source.finish()


def stream_version(repo_id: str, commit: str, meta: dict[str, Any], *, token: str | None = None,
                   endpoint: str | None = None) -> datasets.IterableDataset:
    """The version at ``commit`` (whose ``hs_dataset.json`` is ``meta``, its listing checked) as a streaming
    ``IterableDataset`` read over HTTP, checked block by block (see the module)."""
    shards = recorded_shards(meta, f"{repo_id}@{commit}")
    coded = (meta.get("config") or {}).get("compression", "none") != "none"
    if coded or not all(s["name"].endswith(".arrow") for s in shards):
        return datasets.load_dataset(repo_id, revision=commit, split="train", streaming=True, token=token)
    ex = ArrowExamplesIterable(_tables, {"shards": [dict(s) for s in shards], "repo_id": repo_id, "commit": commit,
                                         "token": token, "endpoint": endpoint})
    return datasets.IterableDataset(ex, split=datasets.Split.TRAIN)
