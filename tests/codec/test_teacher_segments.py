"""The teacher's top-k taken among the best segments' logits (hs_dataset.codec.teacher.topk_of_segments, the GPU
path's, issue 26) is a top-k of the whole vocabulary: the same values as ``torch.topk``, ties included."""

from __future__ import annotations

import pytest
import torch

from hs_dataset.codec.teacher import segment_max, topk_of_segments


@pytest.mark.parametrize("vocab,k,segment", [(32000, 64, 64), (1000, 64, 64), (5000, 16, 32), (100, 64, 64),
                                             (163840, 64, 128), (70, 8, 2048)])
def test_the_top_k_of_the_best_segments_is_the_top_k(vocab, k, segment):
    g = torch.Generator().manual_seed(vocab + k)
    n = 40
    logits = (torch.randn(n, vocab, generator=g) * torch.logspace(-1, 1, n)[:, None]).to(torch.bfloat16)
    logits[1] = 0  # every logit tied
    logits[2] = torch.randint(0, 3, (vocab,), generator=g).to(torch.bfloat16)  # a few values, many ties each
    logits[3, -1] = 100  # the highest in the last, partial segment
    segmax = segment_max(logits, segment)
    assert segmax.shape == (n, -(-vocab // segment))
    ref = torch.stack([torch.tensor([float(logits[i, j * segment:(j + 1) * segment].max()) for j in range(segmax.shape[1])])
                       for i in range(3)])
    assert torch.equal(segmax[:3], ref)
    vals, ids = topk_of_segments(logits, segmax, k, segment)
    ref_vals, _ = logits.topk(k, dim=-1)
    assert ids.shape == (n, k) and bool((ids >= 0).all()) and bool((ids < vocab).all())
    assert torch.equal(vals, ref_vals)  # the same values, highest first
    assert torch.equal(logits.gather(1, ids), vals)  # each id is its value's
    assert all(len(set(r.tolist())) == k for r in ids)  # k distinct ids
    assert int(ids[3, 0]) == vocab - 1
