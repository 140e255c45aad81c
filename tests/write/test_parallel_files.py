"""Shard files written by several threads (issue 26, item 4): the same bytes as one thread writes, through the
file system datasets writes with."""

from __future__ import annotations

import hashlib

import numpy as np
from datasets.arrow_writer import ArrowWriter

from hs_dataset.codec.encode import make_features, row_table
from hs_dataset.write import parallel_files
from hs_dataset.write.parallel_files import ParallelWriter, parallel_url


def test_a_large_write_in_pieces_lands_whole_and_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(parallel_files, "PIECE_BYTES", 4096)
    monkeypatch.setenv("HS_DATASET_WRITE_THREADS", "4")
    data = np.random.default_rng(0).integers(0, 255, size=1_000_003, dtype=np.uint8)
    with ParallelWriter(str(tmp_path / "f")) as f:
        assert f.write(b"head") == 4 and f.write(data) == data.size and f.tell() == data.size + 4
    assert (tmp_path / "f").read_bytes() == b"head" + data.tobytes()


def test_datasets_writes_the_same_shard_through_it(tmp_path, monkeypatch):
    monkeypatch.setattr(parallel_files, "PIECE_BYTES", 1 << 16)
    monkeypatch.setattr(parallel_files, "_pool", None)
    monkeypatch.setenv("HS_DATASET_WRITE_THREADS", "3")
    feats = make_features((0, 1), 256)
    rng = np.random.default_rng(1)
    digests = []
    for where in (str(tmp_path / "plain.arrow"), parallel_url(tmp_path / "parallel.arrow")):
        w = ArrowWriter(features=feats, path=where, writer_batch_size=1)
        for i in range(5):
            T = 700 + i
            row = {"id": f"s{i}", "input_ids": np.arange(T, dtype=np.int32), "loss_mask": np.ones(T, np.uint8),
                   "num_tokens": T, **{c: rng.integers(0, 65535, size=(T, 256), dtype=np.uint16)
                                       for c in ("hidden_layer_0", "hidden_layer_1", "hidden_final")}}
            w.write_row(row_table(row, feats.arrow_schema))
        w.finalize()
        w.close()
        rng = np.random.default_rng(1)
        digests.append(hashlib.sha256((tmp_path / where.rsplit("/", 1)[-1]).read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    assert isinstance(parallel_files._pool, parallel_files.cf.ThreadPoolExecutor)  # the pieces went through the pool
