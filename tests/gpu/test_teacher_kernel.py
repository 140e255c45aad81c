"""The teacher's top-k on the GPU (hs_dataset.codec.teacher: a Triton logsumexp over the bf16 logits that also
takes each segment's maximum, a Triton top-k among the best segments' logits as they are) gives what the PyTorch path
gives from a float32 copy of the logits (issue 26: the builder keeps up with fast storage; the SGLang plugin
computes the teacher this way)."""

from __future__ import annotations

import pytest
import torch

from hs_dataset.codec.teacher import segment_max, teacher_topk, warm_up
from tests.gpu.models import GPU_MARKS

pytestmark = GPU_MARKS


@pytest.mark.parametrize("vocab,rows,dtype,K", [(32000, 2048, torch.bfloat16, 64), (163840, 700, torch.bfloat16, 64),
                                                (1000, 3, torch.bfloat16, 64), (50257, 1500, torch.float32, 64),
                                                (129280, 0, torch.bfloat16, 64), (32000, 500, torch.bfloat16, 13),
                                                (32000, 300, torch.bfloat16, 300),  # the kernel, 512 x 16 candidates
                                                (32000, 200, torch.bfloat16, 1000)])  # torch.topk of the vocabulary
def test_the_kernel_path_gives_the_pytorch_paths_teacher(vocab, rows, dtype, K):
    assert warm_up(vocab, dtype) is None, "the Triton kernels did not compile"
    g = torch.Generator(device="cuda").manual_seed(vocab)
    w = (torch.randn(vocab, 512, device="cuda", generator=g) * 0.05).to(dtype)
    x = (torch.randn(rows, 512, device="cuda", generator=g) * torch.logspace(-2, 1, rows, device="cuda")[:, None])
    x = x.to(dtype)
    if rows > 3:
        x[3] = 0  # every logit equal: ties across the whole vocabulary
    ids, lp, lse = teacher_topk(x, w, K, chunk=1024)
    ref_ids, ref_lp, ref_lse = teacher_topk(x, w, K, chunk=1024, kernel=False)
    assert ids.dtype == torch.int32 and lp.dtype == lse.dtype == torch.float32
    assert ids.shape == ref_ids.shape == (rows, K) and lse.shape == (rows,)
    assert torch.allclose(lse, ref_lse, rtol=1e-6, atol=1e-5), (lse - ref_lse).abs().max()
    assert torch.allclose(lp, ref_lp, rtol=1e-6, atol=1e-5), (lp - ref_lp).abs().max()
    # the ids are those of the same values: each stored log-prob is its id's, and they are a top-K
    logits = torch.nn.functional.linear(x, w).float()
    at = torch.gather(logits, 1, ids.long()) - ref_lse[:, None]
    assert torch.allclose(at, lp, atol=1e-5)
    assert all(len(set(r.tolist())) == K for r in ids)  # K distinct ids
    if rows:  # and no logit left out is higher than the lowest taken (ties may be taken either way)
        rest = logits.scatter(1, ids.long(), float("-inf")).amax(-1)
        assert bool((rest <= torch.gather(logits, 1, ids.long()).amin(-1)).all())
    assert torch.equal(ids[:, 0][lp[:, 0] > lp[:, 1] + 1e-5], ref_ids[:, 0][lp[:, 0] > lp[:, 1] + 1e-5])  # argmax


@pytest.mark.parametrize("vocab,segment", [(32000, 64), (163840, 64), (1000, 32), (70, 128)])
def test_the_kernels_segment_maxima_are_the_logits_maxima(vocab, segment):
    from hs_dataset.codec.teacher_triton import row_logsumexp

    g = torch.Generator(device="cuda").manual_seed(vocab)
    logits = torch.randn(300, vocab, device="cuda", generator=g).to(torch.bfloat16)
    lse, segmax = row_logsumexp(logits, segment)
    assert torch.equal(segmax, segment_max(logits, segment))
    assert torch.allclose(lse, torch.logsumexp(logits.float(), -1), rtol=1e-6, atol=1e-5)
