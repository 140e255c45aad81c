"""Shard files written in the background (issue 26): the bytes ``datasets`` writes through a plain path, several
files at once, a failed write raised naming its file, and the queue bounded."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets.arrow_writer import ArrowWriter

from hs_dataset.codec.encode import make_features, row_table
from hs_dataset.write import native_files
from hs_dataset.integrity.checksums import file_digest
from hs_dataset.write.native_files import BackgroundFile, drain, written
from hs_dataset.write.native_fs import coding_options, native_url


def test_datasets_writes_the_same_shard_through_a_background_file(tmp_path):
    feats = make_features((0, 1), 256)
    digests = []
    for where in (str(tmp_path / "plain.arrow"), native_url(tmp_path / "native.arrow")):
        rng = np.random.default_rng(1)
        w = ArrowWriter(features=feats, path=where, writer_batch_size=1)
        assert isinstance(w.stream, BackgroundFile) == where.startswith("hsds-native://")
        for i in range(5):
            T = 700 + i
            row = {"id": f"s{i}", "input_ids": np.arange(T, dtype=np.int32), "loss_mask": np.ones(T, np.uint8),
                   "num_tokens": T, **{c: rng.integers(0, 65535, size=(T, 256), dtype=np.uint16)
                                       for c in ("hidden_layer_0", "hidden_layer_1", "hidden_final")}}
            w.write_row(row_table(row, feats.arrow_schema))
        w.finalize()
        w.close()
        drain(tmp_path)
        digests.append(hashlib.sha256((tmp_path / where.rsplit("/", 1)[-1]).read_bytes()).hexdigest())
    assert digests[0] == digests[1]


@pytest.mark.parametrize("coding", ["zstd", "parquet"])
def test_a_coded_folders_shards_are_coded_by_their_writers_once_written(tmp_path, coding):
    """A coded build's staging shards: each coded by its own thread as soon as it is written, under the name
    ``datasets`` gives it after closing it; the coded rows equal the written ones. Other files are not coded."""
    feats = make_features((0,), 64)
    rng = np.random.default_rng(3)
    rows = [{"id": f"s{i}", "input_ids": np.arange(50 + i, dtype=np.int32), "loss_mask": np.ones(50 + i, np.uint8),
             "num_tokens": 50 + i, **{c: rng.integers(0, 65535, size=(50 + i, 64), dtype=np.uint16)
                                       for c in ("hidden_layer_0", "hidden_final")}} for i in range(4)]
    opts = coding_options(coding, ("hidden_layer_0", "hidden_final"))
    w = ArrowWriter(features=feats, path=native_url(tmp_path / "x-train-SSSSS.arrow"), writer_batch_size=1,
                    storage_options=opts)
    for row in rows:
        w.write_row(row_table(row, feats.arrow_schema))
    w.finalize()
    w.close()
    fs, path = fsspec.core.url_to_fs(native_url(tmp_path / "info.json"), **opts)
    with fs.open(path, "wb") as f:
        f.write(b"{}")
    os.replace(tmp_path / "x-train-SSSSS.arrow", tmp_path / "x-train-00000.arrow")  # numbered after closing
    drained = drain(tmp_path)
    assert written(drained, tmp_path / "info.json").coded is None
    done = written(drained, tmp_path / "x-train-00000.arrow").coded
    assert done is not None and done.rows == 4 and done.digest == file_digest(done.path)
    plain = pa.ipc.open_stream(pa.memory_map(str(tmp_path / "x-train-00000.arrow"))).read_all()
    got = pq.read_table(done.path) if coding == "parquet" else pa.ipc.open_stream(pa.memory_map(done.path)).read_all()
    assert got.equals(plain)
    if coding == "zstd":  # Arrow compressed the buffers: a plain reader decodes them
        assert os.path.getsize(done.path) < os.path.getsize(tmp_path / "x-train-00000.arrow")


def test_files_written_at_once_each_land_whole_and_in_order(tmp_path):
    rng = np.random.default_rng(2)
    chunks = {k: [rng.integers(0, 255, size=int(rng.integers(1, 300_000)), dtype=np.uint8) for _ in range(40)]
              for k in range(3)}
    files = {k: BackgroundFile(str(tmp_path / f"f{k}")) for k in chunks}
    for j in range(40):  # interleaved, as parts in flight write their shards
        for k, f in files.items():
            assert f.write(chunks[k][j]) == chunks[k][j].size
    assert all(f.tell() == sum(c.size for c in chunks[k]) for k, f in files.items())
    for f in files.values():
        f.close()
    os.replace(tmp_path / "f0", tmp_path / "renamed")  # datasets numbers its shards after writing them
    digests = drain(tmp_path)
    for k in chunks:
        path = tmp_path / ("renamed" if k == 0 else f"f{k}")
        assert path.read_bytes() == b"".join(c.tobytes() for c in chunks[k])
        assert written(digests, path).digest == file_digest(path)  # hashed by its writer, as written
        assert written(digests, path).coded is None
    assert not native_files._files  # drained files are let go
    (tmp_path / "f1").write_bytes(b"rewritten")  # the same file, other bytes: no digest, it is hashed from disk
    assert written(digests, tmp_path / "f1") is None


def test_a_failed_write_is_raised_naming_the_file():
    f = BackgroundFile("/dev/full")  # every write fails with ENOSPC, like a full disk
    f.write(b"x" * 4096)
    f.close()
    with pytest.raises(OSError) as e:
        drain("/dev")
    assert e.value.errno == errno.ENOSPC and e.value.filename == "/dev/full"
    g = BackgroundFile("/dev/full")
    g.write(b"x")
    deadline = time.monotonic() + 10
    while g._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(OSError, match="No space left"):  # the next write raises it at once
        g.write(b"y")
    with pytest.raises(OSError):
        drain("/dev")


def test_writes_wait_while_the_queue_is_full(tmp_path, monkeypatch):
    monkeypatch.setattr(native_files, "QUEUE_BYTES", 1 << 20)
    fifo = tmp_path / "slow"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a disk that takes nothing until it is read
    f = BackgroundFile(str(fifo))
    written: list[int] = []

    def producer() -> None:
        for _ in range(8):
            written.append(f.write(bytes(512 << 10)))

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(1.0)
    assert t.is_alive() and len(written) <= 4  # 4 MiB offered, at most 1 MiB queued beside what the pipe holds
    got = 0
    os.set_blocking(reader, True)
    while got < 8 * (512 << 10):
        got += len(os.read(reader, 1 << 20))
    t.join(10)
    assert not t.is_alive() and len(written) == 8
    f.close()
    drain(tmp_path)
    os.close(reader)


def test_the_file_system_lists_moves_and_removes_like_the_local_one(tmp_path):
    fs, path = fsspec.core.url_to_fs(native_url(tmp_path / "d"))
    fs.makedirs(path, exist_ok=True)
    with fs.open(f"{path}/a", "wb") as f:
        f.write(b"abc")
    drain(tmp_path)
    assert [e["name"].rsplit("/", 1)[-1] for e in fs.ls(path)] == ["a"] and fs.info(f"{path}/a")["size"] == 3
    fs.mv(f"{path}/a", f"{path}/b")
    with fs.open(f"{path}/b", "rb") as f:
        assert f.read() == b"abc"
    fs.rm(path, recursive=True)
    assert not (tmp_path / "d").exists()


def test_a_file_still_being_written_is_moved_by_its_thread_after_its_last_write(tmp_path):
    """datasets numbers its shards by moving them once closed; a rename waits for the file's inode lock, which
    its writes hold, so the move of a file with writes queued is made by its thread and returns at once."""
    fifo = tmp_path / "slow"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a disk that takes nothing until it is read
    f = BackgroundFile(str(fifo))
    f.write(bytes(4 << 20))  # more than the pipe holds: the thread is blocked in a write
    f.close()
    fs, path = fsspec.core.url_to_fs(native_url(tmp_path))
    t = time.monotonic()
    fs.mv(f"{path}/slow", f"{path}/moved")
    assert time.monotonic() - t < 1.0
    assert fifo.exists() and not (tmp_path / "moved").exists()  # not yet: its writes are still queued
    os.set_blocking(reader, True)
    got = 0
    while got < 4 << 20:
        got += len(os.read(reader, 1 << 20))
    drain(tmp_path)
    os.close(reader)
    assert (tmp_path / "moved").exists() and not fifo.exists()
    # moved twice: at the last name, whether its thread was still writing (moved by it) or done (moved at once)
    g = BackgroundFile(str(tmp_path / "a"))
    g.write(b"abc")
    g.close()
    fs.mv(f"{path}/a", f"{path}/b")
    fs.mv(f"{path}/b", f"{path}/c")
    drained = drain(tmp_path)
    assert (tmp_path / "c").read_bytes() == b"abc" and not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert written(drained, tmp_path / "c").digest == file_digest(tmp_path / "c")
    fs.mv(f"{path}/c", f"{path}/d")  # drained: an ordinary rename
    assert (tmp_path / "d").read_bytes() == b"abc"
