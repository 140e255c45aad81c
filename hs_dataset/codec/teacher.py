"""The teacher's top-k: what an EAGLE-3 distillation loss needs of the target's next-token distribution.

At each position the target's logits are ``lm_head(final)`` (the final post-norm state times the output
embedding, in the model's dtype, as the model computes them), over the full vocabulary. Instead of the
final state (14 KB a token at Kimi width) a build can store, at loss-masked positions, the top-``k`` token
ids and their log-probabilities ``log_softmax(logits)`` (float32) and the full-vocabulary logsumexp
(float32): ``k * 8 + 4`` bytes (516 for k = 64). The argmax is the first id (ids are sorted by
probability, highest first). The same function runs on the GPU in the SGLang plugin and on the device
of the transformers reference, so both backends store the same numbers (up to the matrix product's
rounding on each device).

Torch only: the SGLang plugin imports this module in the scheduler process.
"""

from __future__ import annotations

import torch

from hs_dataset.layout import parse_teacher

__all__ = ["TEACHER_CHUNK", "parse_teacher", "teacher_topk"]

TEACHER_CHUNK = 1024  # positions per matrix product: [1024, vocab] float32 logits (0.67 GB at Kimi's 163,840)


def teacher_topk(final: torch.Tensor, weight: torch.Tensor, k: int, *,
                 chunk: int = TEACHER_CHUNK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``k`` of ``log_softmax(final @ weight.T)`` per row: ids int32 ``[n, k]`` (highest first),
    log-probs float32 ``[n, k]``, logsumexp float32 ``[n]``; on ``final``'s device.

    ``weight``: the output embedding ``[vocab, H]`` (only the vocabulary's rows: no padding rows). The
    product runs in ``final``'s dtype (bf16, as the model's ``lm_head``), the softmax in float32.
    """
    n = final.shape[0]
    ids = torch.empty((n, k), dtype=torch.int32, device=final.device)
    logprobs = torch.empty((n, k), dtype=torch.float32, device=final.device)
    lse = torch.empty((n,), dtype=torch.float32, device=final.device)
    w = weight.to(final.dtype)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        logits = torch.nn.functional.linear(final[a:b], w).float()
        s = torch.logsumexp(logits, dim=-1)
        vals, top = logits.topk(k, dim=-1)
        ids[a:b] = top.to(torch.int32)
        logprobs[a:b] = vals - s[:, None]
        lse[a:b] = s
        del logits
    return ids, logprobs, lse
