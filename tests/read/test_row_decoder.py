"""One row decoder (issue 50, item 2): the walk over the Array2D offsets and the fp8/bf16 choice live in
hs_dataset.codec.rows only, and every reader (decode_row, the windows, the recount's rows, the probe's rows)
gives the same states through it; read/stats.py takes what the build recorded instead of recounting it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from hs_dataset.integrity.probe_inputs import read_rows
from hs_dataset.integrity.scan import iter_shard_rows
from hs_dataset.read import decode_row, open_dataset
from hs_dataset.read.stats import build_stats
from hs_dataset.read.windows import iter_windows
from tests.fixtures.builds import random_build

PKG = Path(__file__).resolve().parents[2] / "hs_dataset"
READERS = ["read/decode.py", "read/windows.py", "integrity/scan.py", "integrity/probe_inputs.py", "read/stats.py"]


def test_the_offsets_walk_and_the_fp8_choice_are_written_once():
    for rel in READERS:
        text = (PKG / rel).read_text()
        assert ".offsets" not in text, f"{rel} walks Arrow offsets itself: use hs_dataset.codec.rows"
        assert not re.search(r"\bfp8_decode\(|torch\.uint8\b.*\n.*fp8|== torch\.uint16", text), \
            f"{rel} chooses between fp8 and bf16 itself: use hs_dataset.codec.rows.state_from_bits"
    assert ".offsets" in (PKG / "codec" / "rows.py").read_text()


@pytest.fixture(scope="module", params=["bfloat16", "fp8_e4m3"])
def built(request, tmp_path_factory) -> Path:
    return random_build(tmp_path_factory.mktemp(request.param), samples=6, tokens=48, hidden=64,
                        storage_dtype=request.param)


def test_every_reader_gives_the_same_states(built):
    ds = open_dataset(built)
    meta = json.loads((built / "hs_dataset.json").read_text())
    columns = meta["columns"]
    rows = [decode_row(ds.with_format("arrow")[i]) for i in range(len(ds))]
    windows = list(iter_windows(ds, 10_000))
    probed = read_rows(meta, list(range(len(ds))), lambda s: built / "data" / s["name"])
    raw = [r for s in meta["shards"] for r in iter_shard_rows(built / "data" / s["name"])]
    assert len(rows) == len(windows) == len(probed) == len(raw) == 6
    for row, win, pr, r in zip(rows, windows, probed, raw):
        assert row["id"] == win["id"] == pr.sample_id == r["id"]
        assert np.array_equal(row["input_ids"].numpy(), r["input_ids"])
        for c in columns:
            assert row[c].dtype == torch.bfloat16 and row[c].shape == (48, 64)
            assert torch.equal(row[c].view(torch.int16), win[c].view(torch.int16)), c
            assert torch.equal(row[c].view(torch.int16), pr.states[c].view(torch.int16)), c
            assert r[c].shape == (48, 64) and r[c].dtype == (np.uint8 if "fp8" in meta["storage_dtype"] else np.uint16)


def test_inspect_takes_the_recorded_statistics(built):
    meta = json.loads((built / "hs_dataset.json").read_text())
    recorded = meta["statistics"]
    stats = build_stats(built, sample_rows=2)  # two rows sampled: a recount of them would differ
    assert stats.masked_tokens == recorded["masked_tokens"]
    for s in stats.states:
        rec = recorded["columns"][s.column]
        assert (s.mean, s.std, s.absmax) == (rec["mean"], rec["std"], rec["absmax"]), s.column
        assert len(s.token_norms) == 2 * 48  # the figure's norms: the sampled rows
