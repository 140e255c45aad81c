"""Derived versions: the selected rows, bit for bit; they verify, push, and share nearly all their chunks with the
versions they come from."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from hs_dataset.cli import main
from hs_dataset.integrity.teacher_stats import iter_position_stats, load_output_embedding, write_sample_stats
from hs_dataset.derive.version import derive
from hs_dataset.errors import ConfigError
from hs_dataset.integrity.verify import verify_build
from hs_dataset.write.driver import build
from tests.fixtures.builds import ROOT, config, load_built

sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import derived_uploads  # UniqueStates, make_versions(), upload_figures()
finally:
    sys.path.pop(0)

SAMPLES = 24


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> list[Path]:
    """Three versions (sources a, b, c) of 24 rows each, with tags; states random and different for every row
    (1 MiB a row), one row a record batch, as the default byte budget gives rows at Kimi width."""
    return derived_uploads.make_versions(tmp_path_factory.mktemp("derive-src"), SAMPLES)


def rows_by_id(out: Path) -> dict[str, dict]:
    ds = load_built(out).with_format("numpy")
    return {r["id"]: r for r in ds}


def assert_same_rows(derived: Path, sources: list[Path], ids: list[str]) -> None:
    got = load_built(derived).with_format("numpy")
    assert got["id"] == ids
    src = {}
    for s in sources:
        src.update(rows_by_id(s))
    for row in got:
        want = src[row["id"]]
        for c in row:
            assert np.array_equal(np.asarray(row[c]), np.asarray(want[c])), (row["id"], c)


def test_a_budget_keeps_exactly_the_drawn_rows_deterministically_and_verifies(sources, tmp_path):
    a = sources[0]
    s = derive([a], tmp_path / "half", budget=SAMPLES // 2, seed=7)
    assert s.rows == SAMPLES // 2
    again = derive([a], tmp_path / "again", budget=SAMPLES // 2, seed=7)
    other = derive([a], tmp_path / "other", budget=SAMPLES // 2, seed=8)
    ids = load_built(tmp_path / "half")["id"]
    assert load_built(tmp_path / "again")["id"] == ids != load_built(tmp_path / "other")["id"]
    assert again.rows == other.rows == s.rows
    src_ids = load_built(a)["id"]
    assert ids == [i for i in src_ids if i in set(ids)]  # in the source's order
    assert_same_rows(tmp_path / "half", [a], ids)
    assert verify_build(tmp_path / "half").ok
    assert main(["verify", str(tmp_path / "half")]) == 0
    meta = json.loads((tmp_path / "half" / "hs_dataset.json").read_text())
    assert meta["derived"]["query"] == {"where": [], "weights": None, "budget": 12, "keep_flattest": None, "seed": 7}
    assert meta["derived"]["sources"][0]["path"] == str(a) and meta["derived"]["sources"][0]["rows_kept"] == 12
    assert "## Derived version" in (tmp_path / "half" / "README.md").read_text()


def test_filters_on_tags_and_a_weighted_mix(sources, tmp_path):
    assert main(["derive", str(sources[0]), "--output", str(tmp_path / "f"), "--where", "tag_row >= 20",
                 "--where", "tag_tokens == 128"]) == 0
    assert load_built(tmp_path / "f")["tag_row"] == [20, 21, 22, 23]
    s = derive(sources, tmp_path / "mix", weights=[0.5, 0.25, 0.25], budget=16, seed=1)
    assert s.rows_per_source == [8, 4, 4]
    got = load_built(tmp_path / "mix")
    assert [t.split(":")[0] for t in got["id"]] == ["src-a"] * 8 + ["src-b"] * 4 + ["src-c"] * 4
    assert_same_rows(tmp_path / "mix", sources, got["id"])
    assert verify_build(tmp_path / "mix").ok
    with pytest.raises(ConfigError, match="no column 'tag_nope'"):
        derive([sources[0]], tmp_path / "bad", where=["tag_nope == 1"])
    with pytest.raises(ConfigError, match="COLUMN OP VALUE"):
        derive([sources[0]], tmp_path / "bad2", where=["tag_row is big"])


def test_a_derived_push_uploads_a_few_percent_of_its_sources(sources, tmp_path, hub):
    """50% subset and a 3-way mix, pushed to the local Hub after their sources: the bytes Xet would upload
    (content-defined chunks the Hub does not hold yet; and the real Xet client's count, when installed)."""
    from hs_dataset.hub.publish import push_dataset

    for k, s in enumerate(sources):
        push_dataset(s, f"org/src-{'abc'[k]}", "v1.0")
    derive([sources[0]], tmp_path / "half", budget=SAMPLES // 2, seed=3)
    derive(sources, tmp_path / "mix", weights=[1, 1, 1], budget=SAMPLES, seed=3)
    figures = {}
    for name, olds in (("half", sources[:1]), ("mix", sources)):
        push_dataset(tmp_path / name, f"org/{name}", "v1.0")
        figures[name] = derived_uploads.upload_figures(olds, tmp_path / name, tmp_path / "cas")
        assert figures[name]["upload_bytes"] <= 0.10 * figures[name]["source_bytes"], (name, figures[name])
        if "xet_new_bytes" in figures[name]:
            assert figures[name]["xet_new_bytes"] <= 0.10 * figures[name]["source_bytes"], (name, figures[name])
    print("derived push figures:", json.dumps(figures))


def test_the_flattest_positions_narrow_the_mask_and_keep_the_states(tiny_model, tmp_path):
    src = tmp_path / "teacher"
    build(config(tiny_model, max_samples=8, teacher="topk:8"), src, progress=False)
    write_sample_stats(src)
    s = derive([src], tmp_path / "flat", keep_flattest=0.5, where=["stat_entropy_mean > 0"])
    assert 0.45 <= s.positions_masked_after / s.positions_masked_before <= 0.55
    weight = load_output_embedding(tiny_model)
    entropy = {rid: (where, h) for _, rid, where, h, _ in iter_position_stats(src, json.loads(
        (src / "hs_dataset.json").read_text()), "hidden_final", weight)}
    cut = np.quantile(np.concatenate([h for _, h in entropy.values()]), 0.5, method="higher")
    before, after = rows_by_id(src), load_built(tmp_path / "flat").with_format("numpy")
    assert len(after) == 8 - s.dropped_rows
    for row in after:
        old = before[row["id"]]
        where, h = entropy[row["id"]]
        assert np.flatnonzero(row["loss_mask"]).tolist() == where[h >= cut].tolist()
        for c in ("input_ids", "hidden_layer_0", "hidden_layer_1", "hidden_layer_2", "hidden_final"):
            assert np.array_equal(row[c], old[c]), c  # states untouched
        kept = np.isin(np.flatnonzero(old["loss_mask"]), where[h >= cut])
        for c in ("teacher_ids", "teacher_logprobs", "teacher_lse"):
            assert np.array_equal(row[c], np.asarray(old[c])[kept]), c
    assert verify_build(tmp_path / "flat").ok
