"""The teacher's top-k (issue 26): the GPU path's kernels take it among the best segments' logits, which is a top-k of
the whole vocabulary (the same values as ``torch.topk``, ties included); a pass's spans and chunks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hs_dataset.codec.teacher import chunk_rows, segment_for, teacher_topk, teacher_topk_spans

ROOT = Path(__file__).resolve().parents[2]


# Run in a child with TRITON_INTERPRET=1 (read when the kernels are defined): Triton's interpreter runs them with NumPy
_INTERPRETED = r"""
import json, sys
import torch
from hs_dataset.codec.teacher import segment_max
from hs_dataset.codec.teacher_triton import row_logsumexp, segment_topk

vocab, k, segment, n = json.loads(sys.argv[1])
g = torch.Generator().manual_seed(vocab + k)
logits = (torch.randn(n, vocab, generator=g) * torch.logspace(-1, 1, n)[:, None]).to(torch.bfloat16)
logits[1] = 0  # every logit tied
logits[2] = torch.randint(0, 3, (vocab,), generator=g).to(torch.bfloat16)  # a few values, many ties each
logits[3, -1] = 100  # the highest in the last, partial segment
lse, segmax = row_logsumexp(logits, segment)
assert torch.equal(segmax, segment_max(logits, segment))
assert torch.allclose(lse, torch.logsumexp(logits.float(), -1), rtol=1e-6, atol=1e-5)
ids = torch.full((n, k), -7, dtype=torch.int32)
logprobs = torch.empty((n, k))
segment_topk(logits, segmax, lse, segment, ids, logprobs)
ref_vals, _ = logits.float().topk(k, dim=-1)
assert bool((ids >= 0).all()) and bool((ids < vocab).all())
vals = logits.float().gather(1, ids.long())
assert torch.equal(vals, ref_vals), "not the top-k values, highest first"
assert torch.equal(logprobs, vals - lse[:, None])
assert all(len(set(r.tolist())) == k for r in ids), "k distinct ids"
assert int(ids[3, 0]) == vocab - 1
assert ids[1].tolist() == list(range(k)), "tied values: the lowest ids first"
print("ok")
"""


@pytest.mark.parametrize("vocab,k,segment", [(32000, 64, 32), (1000, 64, 64), (5000, 13, 32), (100, 64, 64),
                                             (70, 8, 2048)])
def test_the_kernels_take_the_top_k_of_the_best_segments_which_is_the_top_k(vocab, k, segment):
    """The GPU path's kernels (hs_dataset.codec.teacher_triton), run by Triton's interpreter on the CPU: the segments'
    maxima and the logsumexp are PyTorch's, and the top-k among the logits of the k segments with the highest maxima
    is ``torch.topk``'s: the same values, highest first, ties included (the GPU test runs them compiled)."""
    pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it on Linux x86-64)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _INTERPRETED, json.dumps([vocab, k, segment, 5])], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_a_passs_spans_give_each_requests_own_top_k():
    """teacher_topk_spans (the SGLang plugin's: one call for the requests of a pass that follow one another with
    the same k) gives each span what teacher_topk of its rows alone gives, whatever the spans' order and gaps."""
    g = torch.Generator().manual_seed(7)
    final = torch.randn(100, 16, generator=g).to(torch.bfloat16)
    weight = torch.randn(300, 16, generator=g).to(torch.bfloat16)
    spans = [(40, 10, 8), (0, 25, 8), (25, 15, 8), (50, 5, 4), (70, 30, 8), (55, 1, 4)]  # unsorted; a gap 56..70
    got = teacher_topk_spans(final, weight, spans)
    assert len(got) == len(spans)
    for (off, n, k), (ids, logprobs, lse) in zip(spans, got):
        ref = teacher_topk(final[off:off + n], weight, k, chunk=7)
        assert ids.shape == (n, k)
        assert torch.equal(ids, ref[0]) and torch.equal(logprobs, ref[1]) and torch.equal(lse, ref[2]), (off, n, k)


def test_a_chunk_of_positions_holds_about_a_quarter_gigabyte_of_logits():
    assert chunk_rows(32000) == 4194 and chunk_rows(163840) == 1024 and chunk_rows(1000) == 134217


def test_segments_balance_the_maxima_and_the_candidates():
    """segment_for: the power of two at or above sqrt(vocab / k), within 16..2,048 (what the H200 measured best at
    32,000 and 163,840 for k = 64)."""
    assert segment_for(32000, 64) == 32 and segment_for(163840, 64) == 64
    assert segment_for(1000, 64) == 16 and segment_for(32000, 1) == 256 and segment_for(10**9, 1) == 2048
    for vocab, k in [(32000, 64), (163840, 64), (50257, 13), (129280, 300)]:
        seg = segment_for(vocab, k)
        assert seg & (seg - 1) == 0 and seg / 2 < (vocab / k) ** 0.5 <= seg
