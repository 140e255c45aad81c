"""Shard files written in the background (issue 26): the bytes ``datasets``' ArrowWriter writes into a plain path
and into a BackgroundFile, several files at once, a failed write raised naming its file, and the queue bounded."""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets.arrow_writer import ArrowWriter

from hs_dataset.codec.encode import make_features, row_table
from hs_dataset.write import native_files
from hs_dataset.integrity.checksums import file_digest
from hs_dataset.write.native_files import BackgroundFile, drain, written


def test_datasets_writes_the_same_shard_through_a_background_file(tmp_path):
    feats = make_features((0, 1), 256)
    digests = []
    for name in ("plain.arrow", "native.arrow"):
        rng = np.random.default_rng(1)
        path = str(tmp_path / name)
        w = ArrowWriter(features=feats, path=path, writer_batch_size=1) if name == "plain.arrow" else \
            ArrowWriter(features=feats, stream=BackgroundFile(path), writer_batch_size=1)
        for i in range(5):
            T = 700 + i
            row = {"id": f"s{i}", "input_ids": np.arange(T, dtype=np.int32), "loss_mask": np.ones(T, np.uint8),
                   "num_tokens": T, **{c: rng.integers(0, 65535, size=(T, 256), dtype=np.uint16)
                                       for c in ("hidden_layer_0", "hidden_layer_1", "hidden_final")}}
            w.write_row(row_table(row, feats.arrow_schema))
        w.finalize()
        w.close()
        drain(tmp_path)
        digests.append(hashlib.sha256((tmp_path / name).read_bytes()).hexdigest())
    assert digests[0] == digests[1]


@pytest.mark.parametrize("coding", ["zstd", "parquet"])
def test_a_coded_folders_shards_are_coded_by_their_writers_once_written(tmp_path, coding):
    """A coded build's staging shards: each coded by its own thread as soon as it is written; the coded rows equal
    the written ones. A file opened without a coding is not coded."""
    feats = make_features((0,), 64)
    rng = np.random.default_rng(3)
    rows = [{"id": f"s{i}", "input_ids": np.arange(50 + i, dtype=np.int32), "loss_mask": np.ones(50 + i, np.uint8),
             "num_tokens": 50 + i, **{c: rng.integers(0, 65535, size=(50 + i, 64), dtype=np.uint16)
                                       for c in ("hidden_layer_0", "hidden_final")}} for i in range(4)]
    stream = BackgroundFile(str(tmp_path / "x-train-00000.arrow"), coding, ("hidden_layer_0", "hidden_final"))
    w = ArrowWriter(features=feats, stream=stream, writer_batch_size=1)
    for row in rows:
        w.write_row(row_table(row, feats.arrow_schema))
    w.finalize()
    w.close()
    info = BackgroundFile(str(tmp_path / "info.json"))
    info.write(b"{}")
    info.close()
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
    digests = drain(tmp_path)
    for k in chunks:
        path = tmp_path / f"f{k}"
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


def test_drain_waits_for_files_opened_by_a_relative_path(tmp_path, monkeypatch):
    """A build given a relative --output opens its shards by relative paths: drain() must still wait for them
    (it once matched files by absolute folder only, and a part was committed while its shard was half written)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "part").mkdir()
    gate = threading.Event()
    real = native_files.write_all

    def slow_write(fd, data):  # the writer thread is held until drain() is waiting
        gate.wait(5)
        return real(fd, data)

    monkeypatch.setattr(native_files, "write_all", slow_write)
    f = BackgroundFile(os.path.join("part", "shard.arrow"))
    f.write(b"x" * 4096)
    f.close()
    threading.Timer(0.3, gate.set).start()
    drained = drain("part")
    assert os.path.getsize(tmp_path / "part" / "shard.arrow") == 4096
    assert written(drained, tmp_path / "part" / "shard.arrow") is not None
