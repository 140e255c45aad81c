"""Per-row teacher statistics (sample_stats.parquet) against a direct computation on the tiny model."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from hs_dataset.cli import main
from hs_dataset.integrity.teacher_stats import read_sample_stats, write_sample_stats
from hs_dataset.layout import SAMPLE_STATS_FILE
from hs_dataset.read.iterate import iter_torch
from hs_dataset.read.open import open_dataset
from hs_dataset.write.driver import build
from tests.fixtures.builds import config


@pytest.fixture(scope="module")
def built(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("stats") / "out"
    build(config(tiny_model, max_samples=8, teacher="topk:16", sample_stats=True), out, progress=False)
    return out


def direct(tiny_model, out):
    """entropy and top-1 at the masked positions from log_softmax(lm_head(hidden_final)) (float32)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rows = []
    for row in iter_torch(open_dataset(out)):
        final = row["hidden_final"][row["loss_mask"].bool()].float()
        with torch.no_grad():
            lp = torch.log_softmax(lm.lm_head(final), dim=-1)
        h = -(lp.exp() * lp).sum(-1)
        rows.append((row["id"], h, lp.max(-1).values.exp(), row["teacher_logprobs"]))
    return rows


def test_statistics_from_hidden_final_equal_log_softmax_of_lm_head(tiny_model, built):
    stats = read_sample_stats(built).to_pylist()  # written by the build (sample_stats=true)
    want = direct(tiny_model, built)
    assert len(stats) == len(want) == 8
    for s, (rid, h, top1, _) in zip(stats, want):
        assert s["id"] == rid and s["stat_positions"] == h.numel() > 0
        assert s["stat_entropy_mean"] == pytest.approx(float(h.mean()), rel=1e-5, abs=1e-5)
        assert s["stat_entropy_max"] == pytest.approx(float(h.max()), rel=1e-5, abs=1e-5)
        assert s["stat_top1_mean"] == pytest.approx(float(top1.mean()), rel=1e-5, abs=1e-6)
        assert s["stat_flatness_mean"] == pytest.approx(1 - float(top1.mean()), abs=1e-6)
    assert pq.read_schema(built / SAMPLE_STATS_FILE).metadata[b"hs_dataset"].startswith(b'{"source": "hidden_final"')


def test_statistics_from_the_stored_teacher_and_by_verify_stats(tiny_model, built, tmp_path, capsys):
    (built / SAMPLE_STATS_FILE).unlink()  # a version built without them: verify --stats writes them
    assert main(["verify", str(built), "--stats", "--model", str(tmp_path / "elsewhere")]) == 0  # no lm_head here
    assert "per-row teacher statistics: not written" in capsys.readouterr().out
    assert not (built / SAMPLE_STATS_FILE).exists()
    assert main(["verify", str(built), "--stats"]) == 0
    assert read_sample_stats(built).num_rows == 8
    write_sample_stats(built, source="teacher")
    stats = read_sample_stats(built).to_pylist()
    for s, (rid, h, top1, teacher) in zip(stats, direct(tiny_model, built)):
        lp = teacher.float()  # the top-16 stored: the entropy over them and the rest as one outcome
        p = lp.exp()
        rest = 1 - p.sum(-1)
        h_k = -(p * lp).sum(-1) - rest * torch.log(rest)
        assert s["stat_entropy_mean"] == pytest.approx(float(h_k.mean()), rel=1e-5)
        assert s["stat_entropy_mean"] <= float(h.mean()) + 1e-3  # a lower bound of the full entropy
        assert s["stat_top1_mean"] == pytest.approx(float(p[:, 0].mean()), rel=1e-6)
        assert s["stat_top1_mean"] == pytest.approx(float(top1.mean()), abs=2e-2)  # bf16 product on the build's side


def test_a_derived_version_keeps_its_rows_statistics(built, tmp_path):
    from hs_dataset.derive.version import derive

    write_sample_stats(built)
    derive([built], tmp_path / "sub", budget=4, seed=2)
    src = {r["id"]: r for r in read_sample_stats(built).to_pylist()}
    got = read_sample_stats(tmp_path / "sub").to_pylist()
    assert [r["row"] for r in got] == [0, 1, 2, 3]
    for r in got:
        assert {k: v for k, v in r.items() if k != "row"} == {k: v for k, v in src[r["id"]].items() if k != "row"}
    flat = max(r["stat_flatness_mean"] for r in got)  # a filter on the derived version's own statistics
    derive([tmp_path / "sub"], tmp_path / "flattest", where=[f"stat_flatness_mean >= {flat}"])
    assert [r["stat_flatness_mean"] for r in read_sample_stats(tmp_path / "flattest").to_pylist()] == [flat]


def test_a_changed_value_in_the_statistics_file_is_refused(built, tmp_path):
    """sample_stats.parquet carries the digest of its values: one changed value (the file rewritten whole, its
    metadata kept, as damage or an edit would leave it) is refused by name, not used to choose rows."""
    import shutil

    import pyarrow as pa

    from hs_dataset.errors import IntegrityError

    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    path = copy / SAMPLE_STATS_FILE
    table = pq.read_table(path)
    values = table.column("stat_entropy_mean").to_pylist()
    values[0] += 0.5
    changed = table.set_column(table.schema.get_field_index("stat_entropy_mean"), "stat_entropy_mean",
                               pa.array(values, pa.float64()))
    pq.write_table(changed.replace_schema_metadata(table.schema.metadata), path)
    with pytest.raises(IntegrityError, match="sample_stats.parquet: its values differ from the digest"):
        read_sample_stats(copy)
    assert read_sample_stats(built).num_rows == 8  # the original reads
