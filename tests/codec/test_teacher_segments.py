"""The teacher's top-k taken among the best segments' logits (hs_dataset.codec.teacher.topk_of_segments, the GPU
path's, issue 26) is a top-k of the whole vocabulary: the same values as ``torch.topk``, ties included."""

from __future__ import annotations

import pytest
import torch

from hs_dataset.codec.teacher import chunk_rows, segment_max, teacher_topk, teacher_topk_spans, topk_of_segments


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
