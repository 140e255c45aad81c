"""The plan: tokenize workers count exactly what the serial plan counts, progress while it tokenizes,
an estimate from a sample, no tokenizer warning about lengths it cuts itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hs_dataset.write.plan import plan_build, sample_ranges
from tests.fixtures.builds import DEMO, THINKING_ROWS, config
from tests.fixtures.cli import SCRIPT, run


def _summary(p) -> tuple:
    return p.lengths, p.masked_tokens, p.truncated, [r.to_dict() for r in p.rejects], p.part_samples, p.part_tokens


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The demo conversations, twice over, with rows the stage rejects among them."""
    lines = DEMO.read_text(encoding="utf-8").splitlines() * 2
    lines[5:5] = ["{not json", json.dumps({"text": "another schema"}), json.dumps(THINKING_ROWS[3])]
    path = tmp_path_factory.mktemp("plan") / "src.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_plan_with_tokenize_workers_counts_what_the_serial_plan_counts(tiny_model, source):
    serial = plan_build(config(tiny_model, source=str(source), max_samples=None, tokenize_workers=0))
    parallel = plan_build(config(tiny_model, source=str(source), max_samples=None, tokenize_workers=2))
    assert _summary(parallel) == _summary(serial)
    assert len(serial.rejects) == 3 and len(serial.lengths) == 128


def test_the_plan_shows_its_progress_in_a_log_and_nothing_with_no_progress(tiny_model, source):
    args = ("plan", SCRIPT, "--model", tiny_model, "--source", str(source), "--set", "tokenize_workers=2")
    r = run(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert lines and all(re.match(r"hs-dataset plan: [\d,]+/131 rows tokenized, [\d,]+ tokens, [\d,]+ tok/s, ", x)
                         for x in lines), lines
    assert len(lines) == 10 and lines[-1].startswith("hs-dataset plan: 131/131 rows tokenized")
    assert "Token indices" not in r.stderr
    quiet = run(*args, "--no-progress")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr[-3000:]
    assert quiet.stdout == r.stdout


def test_a_sample_is_spread_over_the_source_and_scaled_up(tiny_model, source):
    blocks = sample_ranges(1000, 100)
    assert len(blocks) == 16 and sum(e - s for s, e in blocks) == 100
    assert all(a[1] <= b[0] for a, b in zip(blocks, blocks[1:])) and blocks[0][0] == 0 and blocks[-1][1] <= 1000
    assert sample_ranges(10, 10) == sample_ranges(10, 50) == [(0, 10)]
    assert sum(e - s for s, e in sample_ranges(17, 16)) == 16

    full = plan_build(config(tiny_model, source=str(source), max_samples=None))
    est = plan_build(config(tiny_model, source=str(source), max_samples=None), sample=32)
    assert est.sampled == 32 and est.rows == full.rows == 131 and full.sampled is None
    assert est.build_tokens == round(est.tokens * 131 / 32) and full.build_tokens == full.tokens
    assert 0.5 < est.build_tokens / full.tokens < 2  # an estimate of the same source
    r = run("plan", SCRIPT, "--model", tiny_model, "--source", str(source), "--sample", "32", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sample:   32 of the 131 rows tokenized" in r.stdout and "the build: ~" in r.stdout
    assert re.search(r"^tokens:   ~[\d,]+ \(estimated; [\d,]+ in the sample\)", r.stdout, re.M), r.stdout


def test_no_warning_about_sequences_longer_than_the_model_maximum(tmp_path):
    """The rendered text is tokenized beyond the tokenizer's model_max_length and cut to max_length by the stage:
    transformers' 'Token indices sequence length is longer than ...' would be noise."""
    from tests.gpu.models import make_kimi_k25

    model = make_kimi_k25(tmp_path / "kimi", hidden=64, vocab=2048)
    long_reply = " ".join(f"word{i}" for i in range(6000))  # far more than model_max_length (4096) tokens
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "Say many words."},
                                            {"role": "assistant", "content": long_reply}]}) + "\n")
    r = run("plan", SCRIPT, "--model", str(model), "--source", str(src), "--layers", "0",
            "--set", "trust_remote_code=true", "--set", "max_length=8192", "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 to write" in r.stdout and r.stderr == "", r.stderr


def test_long_samples_are_priced_at_the_rate_measured_for_their_length():
    """A 100k-token sample costs what the device measured at 131k, not 2k's rate; depth scales every rate."""
    from types import SimpleNamespace

    from hs_dataset.write.plan_costs import LONG_CONTEXT_RATES, prefill_seconds

    kimi = SimpleNamespace(hidden_size=7168, num_layers=61)  # Kimi-K2.5: the stand-in's width, 61 layers
    rate_2k = 119_521 * 6 / 61
    at = {r.context: r.tokens_per_second * 6 / 61 for r in LONG_CONTEXT_RATES}
    seconds, used = prefill_seconds(SimpleNamespace(info=kimi, lengths=[2000, 30_000, 100_000]), rate_2k)
    assert seconds == pytest.approx(2000 / rate_2k + 30_000 / at[32768] + 100_000 / at[131072])
    assert len(used) == 3 and used[-1].endswith("up to 131,072 tokens")
    other = SimpleNamespace(hidden_size=4096, num_layers=32)  # no long-context rate measured at this width
    assert prefill_seconds(SimpleNamespace(info=other, lengths=[100_000]), 40_000.0)[0] == pytest.approx(2.5)
