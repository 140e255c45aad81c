"""Lossless coding of a build's shards, read by plain ``load_dataset``: Arrow with zstd buffers, or Parquet
with byte planes + zstd.

``compression=zstd`` (:func:`compress_arrow`): the shard stays an Arrow IPC stream, its buffers
compressed with zstd (level :data:`ZSTD_LEVEL`) by Arrow itself, which every Arrow reader (``datasets``,
``load_dataset``, ``streaming=True``) decompresses.

``file_format=parquet`` (:func:`arrow_to_parquet`) codes bf16 smaller than zstd Arrow but several times slower,
written and read: ``datasets`` stores a ``[T, H]`` state as a list of lists, and Parquet encodes a repetition
and a definition level for every one of its values. Parquet is for tools that want Parquet; zstd Arrow is the
compact format that keeps up (sizes and rates: ``benchmarks/storage.py``, ``benchmarks/compact.py``).

Parquet's byte planes:

bf16 bits are a sign, an 8-bit exponent and 7 mantissa bits: of a hidden state's two bytes, the high
one (sign, exponent, one mantissa bit) takes few values and compresses well, the low one hardly at all;
compressing the interleaved bytes mixes the two. Parquet's ``BYTE_STREAM_SPLIT`` encoding stores each
byte position of a column's values as its own stream (byte planes), which ``zstd`` then compresses
plane by plane: lossless, bit-exact on decode, and a standard Parquet encoding (pyarrow, and so
``load_dataset`` and ``streaming=True``, decode it with no custom code). State columns get
byte planes + zstd (level :data:`ZSTD_LEVEL`); the others zstd. Pages are cut by content
(``datasets``' own content-defined chunking options), so a re-version that changes a few rows shares
the rest of the file's pages.

What either costs: a coded shard has no zero-copy form, so a coded build is read decoded
(``load_dataset(dir, streaming=True)``, or ``load_dataset(dir)``, which converts it into the ``datasets``
cache once); an uncoded Arrow build is memory-mapped as it is (:func:`hs_dataset.read.open_dataset`).
Both code one Arrow IPC stream shard (as the builder writes them) into a shard of the same rows, schema
and metadata (:func:`code_shard`). The builder cuts a coded build's staging shards at
:data:`CODED_SHARD_BYTES` and each is coded by the thread that wrote it, as soon as it is written
(:mod:`hs_dataset.write.native_files`), while the next shards are captured.
"""

from __future__ import annotations

import io
import os
from typing import TypeAlias

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = ["CDC_OPTIONS", "CODED_SHARD_BYTES", "ZSTD_LEVEL", "Source", "arrow_to_parquet", "code_shard",
           "compress_arrow"]

CODED_SHARD_BYTES = 128 * 2**20  # staging shards of a coded build: each coded as soon as it is written
ZSTD_LEVEL = 1  # measured: higher levels gain ~1% on near-Gaussian states at several times the CPU
CDC_OPTIONS = {"min_chunk_size": 256 * 1024, "max_chunk_size": 1024 * 1024, "norm_level": 0}  # datasets' defaults


def _leaves(name: str, t: pa.DataType) -> list[str]:
    if isinstance(t, pa.ExtensionType):
        t = t.storage_type
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return _leaves(f"{name}.list.element", t.value_type)
    return [name]


Source: TypeAlias = "str | os.PathLike[str] | pa.Buffer"  # an Arrow IPC stream: its file, or its bytes (a mapping of its file)


def _stream(src: Source) -> pa.NativeFile:
    return pa.BufferReader(src) if isinstance(src, pa.Buffer) else pa.memory_map(str(src))


def arrow_to_parquet(src: Source, dst: io.RawIOBase, state_columns: list[str] | tuple[str, ...]) -> int:
    """Write the rows of the Arrow IPC stream ``src`` as a Parquet file into ``dst`` (written in order, closed when
    done; state columns
    byte-planed + zstd, the rest zstd); returns the rows written."""
    rows = 0
    with _stream(src) as f:
        reader = pa.ipc.open_stream(f)
        schema = reader.schema
        planes = [leaf for c in state_columns if c in schema.names for leaf in _leaves(c, schema.field(c).type)]
        others = [leaf for c in schema.names if c not in state_columns for leaf in _leaves(c, schema.field(c).type)]
        with pa.PythonFile(dst, mode="w") as out, pq.ParquetWriter(
                out, schema, compression="zstd", compression_level=ZSTD_LEVEL, use_dictionary=others,
                column_encoding={leaf: "BYTE_STREAM_SPLIT" for leaf in planes},
                use_content_defined_chunking=CDC_OPTIONS, write_page_index=True) as w:
            for batch in reader:
                w.write_batch(batch)
                rows += batch.num_rows
    return rows


def compress_arrow(src: Source, dst: io.RawIOBase) -> int:
    """Write the rows of the Arrow IPC stream ``src`` as an Arrow IPC stream into ``dst`` (closed when done), its buffers
    compressed with zstd (same schema and metadata, same record batches); returns the rows written.
    A batch's buffers are compressed side by side on Arrow's threads (the bytes do not depend on it)."""
    rows = 0
    options = pa.ipc.IpcWriteOptions(compression=pa.Codec("zstd", compression_level=ZSTD_LEVEL), use_threads=True)
    with _stream(src) as f, pa.PythonFile(dst, mode="w") as out:
        reader = pa.ipc.open_stream(f)
        with pa.ipc.new_stream(out, reader.schema, options=options) as w:
            for batch in reader:
                w.write_batch(batch)
                rows += batch.num_rows
    return rows


def code_shard(coding: str, src: Source, dst: io.RawIOBase, state_columns: tuple[str, ...] = ()) -> int:
    """Code the Arrow IPC stream ``src`` into ``dst``: ``coding`` ``"zstd"`` (:func:`compress_arrow`) or
    ``"parquet"`` (:func:`arrow_to_parquet`, ``state_columns`` byte-planed); returns the rows written."""
    if coding == "parquet":
        return arrow_to_parquet(src, dst, state_columns)
    if coding == "zstd":
        return compress_arrow(src, dst)
    raise ValueError(f"unknown shard coding {coding!r}: zstd or parquet")
