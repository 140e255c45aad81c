"""Shard files written by Arrow itself (issue 26): the bytes ``datasets`` writes through a plain path, and
the build's staging files opened as native ``pyarrow`` files."""

from __future__ import annotations

import hashlib

import fsspec
import numpy as np
import pyarrow as pa
from datasets.arrow_writer import ArrowWriter

from hs_dataset.codec.encode import make_features, row_table
from hs_dataset.write.native_files import native_url


def test_datasets_writes_the_same_shard_through_a_native_file(tmp_path):
    feats = make_features((0, 1), 256)
    digests = []
    for where in (str(tmp_path / "plain.arrow"), native_url(tmp_path / "native.arrow")):
        rng = np.random.default_rng(1)
        w = ArrowWriter(features=feats, path=where, writer_batch_size=1)
        if where.startswith("hsds-native://"):
            assert isinstance(w.stream, pa.NativeFile)  # Arrow writes the buffers itself, no Python file between
        for i in range(5):
            T = 700 + i
            row = {"id": f"s{i}", "input_ids": np.arange(T, dtype=np.int32), "loss_mask": np.ones(T, np.uint8),
                   "num_tokens": T, **{c: rng.integers(0, 65535, size=(T, 256), dtype=np.uint16)
                                       for c in ("hidden_layer_0", "hidden_layer_1", "hidden_final")}}
            w.write_row(row_table(row, feats.arrow_schema))
        w.finalize()
        w.close()
        digests.append(hashlib.sha256((tmp_path / where.rsplit("/", 1)[-1]).read_bytes()).hexdigest())
    assert digests[0] == digests[1]


def test_the_file_system_lists_moves_and_removes_like_the_local_one(tmp_path):
    fs, path = fsspec.core.url_to_fs(native_url(tmp_path / "d"))
    fs.makedirs(path, exist_ok=True)
    with fs.open(f"{path}/a", "wb") as f:
        f.write(b"abc")
    assert [e["name"].rsplit("/", 1)[-1] for e in fs.ls(path)] == ["a"] and fs.info(f"{path}/a")["size"] == 3
    fs.mv(f"{path}/a", f"{path}/b")
    with fs.open(f"{path}/b", "rb") as f:
        assert f.read() == b"abc"
    fs.rm(path, recursive=True)
    assert not (tmp_path / "d").exists()
