"""Samples larger than the ring (issue 25): a windowed region passes a long sample through the ring piece
by piece while the producer waits for room; the rows equal those of a ring that holds the sample whole, a
NaN in a later piece takes the sample's rows already written back out, and the builder's memory stays at
the window, not the sample (the producer is tests/fixtures/ring_engine.py: the real transport, a thread
in place of the GPU)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import torch

from hs_dataset.capture.transformers import TransformersBackend
from hs_dataset.integrity.verify import verify_build
from hs_dataset.read.iterate import iter_torch
from hs_dataset.records import TokenizedSample
from hs_dataset.write.driver import build
from tests.fixtures.builds import LAYERS, load_built, wide_model_dir
from tests.fixtures.ring_engine import ThreadEngine
from tests.write.test_long_rows import STATES, long_config, long_source, samples_of

ROOT = Path(__file__).resolve().parents[2]


def reference_states(model: str):
    """States of the tiny model's forward (the whole sample once, then sliced): what both rings carry."""
    ref = TransformersBackend(model, LAYERS, device="cpu")

    @functools.lru_cache(maxsize=2)
    def whole(ids: tuple[int, ...]) -> torch.Tensor:
        s = TokenizedSample("x", np.asarray(ids, np.int32), np.ones(len(ids), np.uint8))
        return next(iter(ref.capture([s]))).states

    return lambda ids, a, b: whole(tuple(ids))[:, a:b]


def test_a_ring_smaller_than_a_sample_gives_the_rows_of_a_ring_that_holds_it(tiny_model, tmp_path):
    src = long_source(tmp_path / "long.jsonl")
    states = reference_states(tiny_model)
    got = {}
    for name, ring_bytes in (("small", 1 << 20), ("whole", 64 << 20)):
        eng = ThreadEngine(tiny_model, LAYERS, states, ring_dir=tmp_path / f"ring-{name}", ring_bytes=ring_bytes,
                           chunk=64)
        try:
            build(long_config(tiny_model, src, row_tokens=128), tmp_path / name, backend=eng, progress=False)
        finally:
            eng.close()
        got[name] = eng.windowed
    # window = prefill chunk + 3 rows = 512 positions of 4 states x 64 (256 KiB): the long samples went windowed
    assert any(got["small"]) and not any(got["whole"])
    a, b = samples_of(tmp_path / "small"), samples_of(tmp_path / "whole")
    assert a.keys() == b.keys() and len(a) == 6
    for sid in a:
        for c in ("input_ids", "loss_mask", *STATES):
            assert torch.equal(a[sid][c], b[sid][c]), (sid, c)
    for name in got:  # the statistics the producer counted chunk by chunk equal a recount from the shards
        report = verify_build(tmp_path / name, stats=True)
        assert report.ok, report.message()


def test_nan_in_a_later_piece_takes_the_samples_written_rows_back_out(tiny_model, tmp_path):
    src = long_source(tmp_path / "long.jsonl")
    ref = reference_states(tiny_model)
    target: list[tuple[int, ...]] = []

    def states(ids, a, b):
        st = ref(ids, a, b).clone()
        if len(ids) > 1000 and not target:
            target.append(tuple(ids))
        if target and tuple(ids) == target[0] and a <= 700 < b:  # the first long sample: NaN at position 700
            st[1, 700 - a] = float("nan")
        return st

    eng = ThreadEngine(tiny_model, LAYERS, states, ring_dir=tmp_path / "ring", ring_bytes=1 << 20, chunk=64)
    try:
        s = build(long_config(tiny_model, src, row_tokens=128, on_nonfinite="reject"), tmp_path / "out",
                  backend=eng, progress=False)
    finally:
        eng.close()
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 1 and rejects[0]["field"] == "hidden_layer_1" and "NaN" in rejects[0]["reason"]
    ds = load_built(tmp_path / "out")
    assert rejects[0]["sample_id"] not in set(ds["id"])  # its first 5 rows (positions 0-639) were written, then dropped
    assert ds.num_rows == s.counts.rows_written and s.counts.written == 5 and s.counts.rejected == 1
    # the statistics recorded are those of the rows left (recounted after the drop), as verify recounts them
    report = verify_build(tmp_path / "out", stats=True)
    assert report.ok, report.message()
    assert all(bool(torch.isfinite(r[c].float()).all()) for r in iter_torch(ds) for c in STATES)


# A build of one 40k-token sample (4 states x 2048 = 16 KiB per token: 625 MiB) through a 128 MiB window of a
# 320 MiB ring (a window fits in half the ring beside one row), in a
# subprocess that reports its peak RSS beside the RSS it had before the build.
BIG = textwrap.dedent("""
    import json, random, sys
    from pathlib import Path
    import torch
    sys.path.insert(0, sys.argv[3])
    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.write.driver import build
    from tests.fixtures.ring_engine import ThreadEngine
    work, model = Path(sys.argv[1]), sys.argv[2]
    pool = torch.randn((4, 2048, 2048), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    def states(ids, a, b):  # what the GPU would hand over: no allocation here, the builder's memory is measured
        return pool[:, :b - a]
    eng = ThreadEngine(model, (0, 1, 2), states, ring_dir=work / "ring", ring_bytes=320 << 20, chunk=2048)
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    before = rss()
    cfg = HiddenStatesConfig(model=model, layers=(0, 1, 2), source=str(work / "src.jsonl"), max_length=40000,
                             row_tokens=2048, backend_options={"device": "cpu"})
    s = build(cfg, work / "out", backend=eng, progress=False)
    eng.close()
    # VmHWM: this process image's peak; ru_maxrss would carry over the parent's across fork + exec
    peak = int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1]) * 1024
    print(json.dumps({"before": before, "peak": peak,
                      "tokens": s.counts.tokens_written, "rows": s.counts.rows_written, "windowed": eng.windowed}))
""")


def test_the_builders_memory_stays_at_the_window_not_the_sample(tmp_path):
    model = wide_model_dir(tmp_path / "wide")
    rng = np.random.default_rng(0)
    words = [" ".join(map(str, rng.integers(0, 10**6, size=8000)))]
    with open(tmp_path / "src.jsonl", "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "count"},
                                         {"role": "assistant", "content": words[0]}]}) + "\n")
    p = subprocess.run([sys.executable, "-c", BIG, str(tmp_path), str(model), str(ROOT)], capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    sample_bytes = r["tokens"] * 4 * 2048 * 2
    # two captures: the model fingerprint's short probe prompt (no window), then the sample through a window
    assert r["tokens"] > 30000 and r["windowed"] == [False, True] and sample_bytes > 450 << 20
    # Peak RSS above what the process held before the build (imports, the tokenizer): at most the window (its
    # ring pages, touched as they are written) and 64 MiB, a third of the sample's states. A builder that held
    # the sample whole would add all 625 MiB of it.
    grown = r["peak"] - r["before"]
    assert grown < (128 << 20) + (64 << 20) and grown < sample_bytes / 3, (grown / 2**20, sample_bytes / 2**20)
