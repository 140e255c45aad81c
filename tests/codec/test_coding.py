"""Lossless coding (issue 26, item 2): a parquet build's shards are byte planes + zstd, a compression=zstd build's
are Arrow streams with zstd buffers; every row decodes bit for bit to the plain Arrow build's, through plain
load_dataset (map-style and streaming) and the tensor reader, and the shards are smaller."""

from __future__ import annotations

import datasets
import pyarrow.parquet as pq
import pytest
import torch

from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import ConfigError
from hs_dataset.integrity.verify import verify_build
from hs_dataset.read.iterate import iter_torch
from hs_dataset.read.open import open_dataset
from hs_dataset.write.driver import build
from tests.fixtures.builds import config, load_built


def rows(ds) -> dict[str, dict]:
    return {r["id"]: r for r in iter_torch(ds)}


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_a_coded_build_decodes_to_the_arrow_builds_rows(tiny_model, backend, tmp_path, dtype):
    sizes = {}
    for fmt in ("arrow", "parquet"):
        build(config(tiny_model, storage_dtype=dtype, file_format=fmt, teacher="topk:4"), tmp_path / fmt,
              backend=backend, progress=False)
        sizes[fmt] = sum(f.stat().st_size for f in (tmp_path / fmt / "data").iterdir())
        assert verify_build(tmp_path / fmt).ok
    shard = next((tmp_path / "parquet" / "data").glob("*.parquet"))
    meta = pq.ParquetFile(shard).metadata.row_group(0)
    enc = {meta.column(j).path_in_schema: meta.column(j) for j in range(meta.num_columns)}
    col = enc["hidden_layer_0.list.element.list.element"]
    assert "BYTE_STREAM_SPLIT" in col.encodings and col.compression == "ZSTD"
    want = rows(load_built(tmp_path / "arrow"))
    for got in (rows(load_built(tmp_path / "parquet")),
                rows(datasets.load_dataset(str(tmp_path / "parquet"), split="train", streaming=True))):
        same_rows(got, want)
    # random weights give near-Gaussian states: the tiny model's 64-wide states, as measured (not tuned)
    assert sizes["parquet"] < sizes["arrow"], sizes


def same_rows(got: dict[str, dict], want: dict[str, dict]) -> None:
    assert got.keys() == want.keys()
    for sid, r in got.items():
        for c, v in r.items():
            if isinstance(v, torch.Tensor):
                same = torch.equal(v.view(torch.int16), want[sid][c].view(torch.int16)) \
                    if v.dtype == torch.bfloat16 else torch.equal(v, want[sid][c])
                assert same, (sid, c)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_a_zstd_build_decodes_to_the_arrow_builds_rows(tiny_model, backend, tmp_path, dtype):
    sizes = {}
    for name, extra in (("plain", {}), ("zstd", {"compression": "zstd"})):
        build(config(tiny_model, storage_dtype=dtype, teacher="topk:4", max_samples=12, **extra), tmp_path / name,
              backend=backend, progress=False)
        sizes[name] = sum(f.stat().st_size for f in (tmp_path / name / "data").iterdir())
        assert verify_build(tmp_path / name).ok
    want = rows(load_built(tmp_path / "plain"))
    for got in (rows(open_dataset(tmp_path / "zstd")), rows(load_built(tmp_path / "zstd")),
                rows(datasets.load_dataset(str(tmp_path / "zstd"), split="train", streaming=True))):
        same_rows(got, want)
    assert sizes["zstd"] < sizes["plain"], sizes


def test_compression_is_for_arrow_shards(tiny_model):
    with pytest.raises(ConfigError, match="compression='zstd' is for arrow shards"):
        HiddenStatesConfig(model=tiny_model, source="x.jsonl", file_format="parquet", compression="zstd")
