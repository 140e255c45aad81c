"""Long samples as token-range rows (issue 25): a sample longer than ``row_tokens`` is stored as rows of at
most that many positions, in order, with ``token_start`` and ``sample_tokens``; their concatenation is the
whole sample, bit for bit; the 2^31-element Arrow limit (forced low) splits rows the same way; a sample
rejected after some of its rows were written leaves none behind."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from hs_dataset.config import HiddenStatesConfig
from hs_dataset.integrity.verify import verify_build
from hs_dataset.read.iterate import iter_torch
from hs_dataset.write.driver import build
from tests.fixtures.builds import LAYERS, config, load_built

STATES = [f"hidden_layer_{k}" for k in LAYERS] + ["hidden_final"]


def long_source(path: Path, n: int = 6, seed: int = 0) -> Path:
    """Conversations of a few hundred to ~1,500 tokens (and a few short ones) for the tiny tokenizer."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(500)]
    with open(path, "w") as f:
        for i in range(n):
            k = rng.choice([20, 400, 900, 1300])
            f.write(json.dumps({"messages": [
                {"role": "user", "content": " ".join(rng.choice(words) for _ in range(k // 3))},
                {"role": "assistant", "content": " ".join(rng.choice(words) for _ in range(k))}]}) + "\n")
    return path


def long_config(model: str, src: Path, **kw) -> HiddenStatesConfig:
    return config(model, **{"source": str(src), "max_length": 2048, "part_size": 3, "max_samples": None,
                            "backend_options": {"device": "cpu", "batch_tokens": 4096}, **kw})


def samples_of(out: Path) -> dict[str, dict]:
    """Rows of a build put back together by sample id (in row order), checking the row columns on the way."""
    got: dict[str, dict] = {}
    for row in iter_torch(load_built(out)):
        sid = row["id"]
        start = int(row.get("token_start", 0))
        s = got.setdefault(sid, {"input_ids": [], "loss_mask": [], **{c: [] for c in STATES}, "next": 0,
                                 "total": int(row.get("sample_tokens", row["input_ids"].shape[0]))})
        assert start == s["next"], f"{sid}: a row starts at {start}, {s['next']} expected (rows out of order)"
        assert row["input_ids"].shape[0] == row["hidden_final"].shape[0] == row["loss_mask"].shape[0]
        s["next"] = start + row["input_ids"].shape[0]
        for c in ("input_ids", "loss_mask", *STATES):
            s[c].append(row[c])
    for sid, s in got.items():
        assert s["next"] == s["total"], f"{sid}: rows cover {s['next']} of {s['total']} positions"
        for c in ("input_ids", "loss_mask", *STATES):
            s[c] = torch.cat(s[c])
    return got


@pytest.fixture(scope="module")
def whole(tiny_model, tmp_path_factory):
    """The reference: every sample in one row (row_tokens above max_length)."""
    d = tmp_path_factory.mktemp("whole")
    src = long_source(d / "long.jsonl")
    out = d / "out"
    build(long_config(tiny_model, src, row_tokens=4096), out, progress=False)
    return src, out


def assert_same_samples(a: Path, b: Path) -> None:
    sa, sb = samples_of(a), samples_of(b)
    assert sa.keys() == sb.keys()
    for sid in sa:
        for c in ("input_ids", "loss_mask", *STATES):
            assert torch.equal(sa[sid][c], sb[sid][c]), (sid, c)


def test_long_samples_are_rows_of_row_tokens_equal_to_whole_rows(tiny_model, whole, tmp_path):
    src, ref = whole
    out = tmp_path / "rows"
    s = build(long_config(tiny_model, src, row_tokens=256), out, progress=False)
    ds = load_built(out)
    assert {"token_start", "sample_tokens"} <= set(ds.column_names)
    assert max(ds["num_tokens"]) == 256 and ds.num_rows > s.counts.written  # long samples span rows
    assert s.counts.rows_written == ds.num_rows
    assert "token_start" not in load_built(ref).column_names  # builds without long rows keep their columns
    assert_same_samples(out, ref)
    assert verify_build(out).ok


def test_the_arrow_offset_limit_forced_low_splits_rows_the_same_way(tiny_model, whole, tmp_path, monkeypatch):
    src, ref = whole
    monkeypatch.setenv("HS_DATASET_ARROW_MAX_ELEMENTS", str(64 * 300))  # 300 positions of hidden 64 per row
    out = tmp_path / "limit"
    build(long_config(tiny_model, src), out, progress=False)  # row_tokens 16384, limited to 300 by Arrow
    ds = load_built(out)
    assert max(ds["num_tokens"]) == 300
    assert_same_samples(out, ref)


@pytest.mark.parametrize("coding", [{}, {"compression": "zstd"}, {"file_format": "parquet"}], ids=["plain", "zstd", "parquet"])
def test_a_sample_rejected_after_its_first_rows_leaves_no_row(tiny_model, whole, tmp_path, coding):
    """NaN from a token late in a long sample: its first rows are clean and written, a later row is not;
    the sample is rejected and the part's shards hold none of its rows (in a coded build, its shards were coded
    as written, then rewritten without the rows and coded again at the commit)."""
    from safetensors.torch import load_file, save_file

    from hs_dataset.prepare.tokenizer import load_tokenizer

    src, ref = whole
    rows = samples_of(ref)
    sid, s = max(rows.items(), key=lambda kv: kv[1]["input_ids"].shape[0])
    ids = s["input_ids"].tolist()
    pos = next(p for p in range(600, len(ids)) if ids[p] not in ids[:p])  # first seen late: rows before it clean
    bad = tmp_path / "nan-model"
    shutil.copytree(tiny_model, bad)
    (f,) = bad.glob("*.safetensors")
    sd = load_file(str(f))
    sd["model.embed_tokens.weight"][ids[pos]] = float("nan")
    save_file(sd, str(f), metadata={"format": "pt"})
    assert load_tokenizer(str(bad)) is not None
    src2 = tmp_path / "src" / src.name  # the same rows (and ids), and short ones the bad token is not in
    src2.parent.mkdir()
    with open(src2, "w") as f:
        f.write(src.read_text())
        for i in range(3):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{i} 1 2"},
                                             {"role": "assistant", "content": "7 8 9 " * 5}]}) + "\n")
    out = tmp_path / "nan"
    summary = build(long_config(str(bad), src2, row_tokens=256, on_nonfinite="reject", **coding), out, progress=False)
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert sid in {r["sample_id"] for r in rejects}
    ds = load_built(out)
    assert sid not in set(ds["id"])
    assert ds.num_rows == summary.counts.rows_written
    assert summary.counts.samples_in == summary.counts.written + summary.counts.rejected
    assert verify_build(out).ok
    for row in iter_torch(ds):  # every row left is of a whole, finite sample
        assert all(bool(torch.isfinite(row[c].float()).all()) for c in STATES)
    assert np.all(np.diff([r["token_start"] for r in iter_torch(ds) if r["id"] == ds[0]["id"]]) > 0)


def test_plan_prices_a_long_build_rows_ring_and_shared_memory(tiny_model, whole):
    from hs_dataset.write.plan import plan_build
    from hs_dataset.write.plan_costs import memory_lines

    src, _ = whole
    p = plan_build(long_config(tiny_model, src, row_tokens=256, backend="sglang",
                               backend_options={"ring_bytes": 3 << 19, "chunked_prefill_size": 64}))
    lines = memory_lines(p)
    rows = sum(-(-n // 256) for n in p.lengths)
    assert lines[0].startswith(f"rows:     {rows:,} rows for {len(p.lengths)} samples")
    # 2,048 tokens x 4 states x 64 x 2 B = 1 MiB: over half the 1.5 MiB ring, so a window of 64 + 3 x 256 rows
    assert "passed through a 1,024-row window of the ring" in lines[1] and "/dev/shm free" in lines[1]
    small = plan_build(long_config(tiny_model, src, row_tokens=256, backend="sglang",
                                   backend_options={"ring_bytes": 1 << 18, "chunked_prefill_size": 64}))
    assert "Raise backend_options.ring_bytes" in memory_lines(small)[1]
