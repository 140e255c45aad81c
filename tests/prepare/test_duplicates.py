"""Duplicate prompts are found before capture (issue 30): ``plan`` and the build say how many and what they
cost; ``duplicates=keep`` (the default) captures them again and names them in hs_dataset.json and the card;
``duplicates=skip`` leaves the identical ones out as rejects of stage ``duplicate`` (samples in = written +
rejected), the same rows across parts and on resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import ConfigError, ConfigMismatchError
from hs_dataset.integrity.verify import verify_build
from hs_dataset.write.driver import build
from hs_dataset.write.plan import plan_build
from tests.fixtures.builds import LAYERS, content_hash

ROOT = Path(__file__).resolve().parents[2]


def source(path: Path) -> Path:
    """12 rows of raw tokens: row 7 repeats row 1 (ids and mask), row 9 repeats row 1's ids with another
    mask, row 10 repeats row 4 (in another part than its original with parts of 4), row 11 repeats row 7."""
    rng = np.random.default_rng(0)
    rows = [{"input_ids": rng.integers(10, 1500, size=int(n)).tolist()} for n in rng.integers(5, 30, size=12)]
    for r in rows:
        r["loss_mask"] = [1] * len(r["input_ids"])
    rows[7] = dict(rows[1])
    rows[9] = {"input_ids": rows[1]["input_ids"], "loss_mask": [0] + rows[1]["loss_mask"][1:]}
    rows[10] = dict(rows[4])
    rows[11] = dict(rows[7])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cfg(model: str, src: Path, **kw) -> HiddenStatesConfig:
    base = dict(model=model, layers=LAYERS, source=str(src), max_length=64, part_size=4,
                backend_options={"device": "cpu"})
    base.update(kw)
    return HiddenStatesConfig(**base)


def test_plan_counts_the_duplicates_and_their_cost(tiny_model, tmp_path):
    src = source(tmp_path / "dups.jsonl")
    plan = plan_build(cfg(tiny_model, src))
    d = plan.duplicates
    assert [(x.row, x.first_row, x.same_mask) for x in d.found] == [(7, 1, True), (9, 1, False), (10, 4, True),
                                                                     (11, 1, True)]
    assert (d.same_ids, d.same_rows) == (4, 3) and len(plan.lengths) == 12 and not plan.rejects
    skip = plan_build(cfg(tiny_model, src, duplicates="skip"))
    assert len(skip.lengths) == 9 and [r.sample_id for r in skip.rejects] == ["dups:7", "dups:10", "dups:11"]
    assert [r.stage for r in skip.rejects] == ["duplicate"] * 3
    assert [r.reason.split(" as ")[1].split()[0] for r in skip.rejects] == ["dups:1", "dups:4", "dups:1"]

    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "plan", str(ROOT / "builder_scripts" / "tiny_demo.py"),
                        "--set", f"model={tiny_model}", "--set", f"source={src}", "--tok-per-s", "100"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("duplicates:"))
    tokens = sum(plan.lengths[i] for i in (7, 9, 10, 11))
    assert "4 samples repeat an earlier sample's token ids (3 with its loss mask too" in line
    assert f"{tokens:,} tokens, {tokens / 100:.1f}s of prefill" in line and "duplicates=keep" in line


def test_kept_duplicates_are_captured_again_and_named(tiny_model, backend, tmp_path):
    src = source(tmp_path / "dups.jsonl")
    out = tmp_path / "keep"
    s = build(cfg(tiny_model, src), out, backend=backend, progress=False)
    assert (s.counts.written, s.counts.rejected) == (12, 0)
    meta = json.loads((out / "hs_dataset.json").read_text())
    d = meta["statistics"]["duplicates"]
    assert (d["policy"], d["same_ids"], d["same_ids_and_mask"], d["skipped"]) == ("keep", 4, 3, 0)
    assert [(x["id"], x["first_id"], x["same_mask"]) for x in d["rows"]] == [
        ("dups:7", "dups:1", True), ("dups:9", "dups:1", False), ("dups:10", "dups:4", True), ("dups:11", "dups:1", True)]
    assert d["tokens"] == sum(len(json.loads(x)["input_ids"]) for i, x in enumerate(src.read_text().splitlines())
                              if i in (7, 9, 10, 11))
    card = (out / "README.md").read_text()
    assert "Duplicate prompts: 4 written samples repeat" in card and "row 10 (`dups:10`) repeats row 4 (`dups:4`)" in card
    assert verify_build(out, stats=True).ok  # recorded duplicates are not problems


def test_skipped_duplicates_are_rejects_of_stage_duplicate_across_parts_and_on_resume(tiny_model, backend, tmp_path):
    src = source(tmp_path / "dups.jsonl")
    out = tmp_path / "skip"
    s = build(cfg(tiny_model, src, duplicates="skip"), out, backend=backend, progress=False)
    c = s.counts
    assert (c.samples_in, c.written, c.rejected, c.rejects_by_stage) == (12, 9, 3, {"duplicate": 3})
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["sample_id"], r["stage"]) for r in rejects] == [("dups:7", "duplicate"), ("dups:10", "duplicate"),
                                                                ("dups:11", "duplicate")]
    assert "dups:4" in rejects[1]["reason"]  # its original is in another part
    meta = json.loads((out / "hs_dataset.json").read_text())
    d = meta["statistics"]["duplicates"]
    assert (d["policy"], d["same_ids"], d["same_ids_and_mask"], d["skipped"]) == ("skip", 1, 0, 3)  # row 9's mask differs
    assert meta["config"]["duplicates"] == "skip" and (out / ".hs_build" / "duplicates.json").is_file()
    before = content_hash(out)

    (out / "data" / "train-00002-000.arrow").unlink()  # part 2 (rows 8-11) redone: the same rows skipped
    again = build(cfg(tiny_model, src, duplicates="skip"), out, backend=backend, progress=False)
    assert again.parts_built == 1 and again.counts.rejects_by_stage == {"duplicate": 3}
    assert content_hash(out) == before
    with pytest.raises(ConfigMismatchError, match="duplicates"):
        build(cfg(tiny_model, src), out, backend=backend, progress=False)  # keep would change the rows

    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "build", str(ROOT / "builder_scripts" / "tiny_demo.py"),
                        "--set", f"model={tiny_model}", "--set", f"source={src}", "--set", "part_size=4",
                        "--set", "max_length=64", "--set", "layers=[0,1,2]", "--duplicates", "skip",
                        "--output", str(tmp_path / "cli"), "--no-progress"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr  # 3 of 12 rejected, but skipped on purpose: not a reject rate
    assert "duplicates=skip: 3 identical rows left out (rejects of stage duplicate)" in r.stdout


def test_skip_is_refused_where_the_tokens_are_not_known_before_capture(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="duplicates=skip needs responses=source"):
        cfg(tiny_model, tmp_path / "x.jsonl", duplicates="skip", responses="regenerate")
