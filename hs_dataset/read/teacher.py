"""The distillation target over a draft vocabulary, from the teacher's top-k (``teacher="topk:K"`` builds).

EAGLE-3 trains the drafter on a draft vocabulary, a subset of the target's (SpecForge's ``t2d``: a bool
per target token, True for the draft's tokens; draft index = the token's rank among them). Its target
at a position is the target model's next-token distribution restricted to those tokens and renormalized::

    p_draft[d(t)] = exp(l_t) / sum over draft tokens t' of exp(l_t')        l = lm_head(final)

From the stored top-k (token ids ``i_1..i_K``, log-probabilities ``lp_j = l_{i_j} - logsumexp(l)``):

    p_draft[d(i_j)] = exp(lp_j) / sum over j' with t2d[i_j'] of exp(lp_j')   for t2d[i_j], else 0

which equals the formula above except that draft tokens outside the top-k get 0: the two differ by at
most the probability outside the top-k, ``1 - sum_j exp(lp_j)``. :func:`draft_target` returns per
position ``covered``, the full distribution's probability of the top-k tokens that are draft tokens (the
target's normalizer). ``position_mask`` is SpecForge's: whether the target's argmax
(``teacher_ids[..., 0]``) is a draft token.
"""

from __future__ import annotations

import torch

__all__ = ["draft_target"]


def draft_target(teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
                 t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(target [..., draft_vocab] float32, position_mask [...] bool, covered [...] float32)`` (see the module
    docstring) from the collator's ``teacher_ids`` / ``teacher_logprobs`` ([..., k]; ids -1 where no teacher).

    ``t2d``: bool ``[target_vocab]``, True for the draft vocabulary's tokens. Positions without a teacher
    (loss mask 0) get an all-zero target and ``position_mask`` False.
    """
    t2d = t2d.to(torch.bool)
    draft_index = torch.cumsum(t2d.long(), 0) - 1  # target id -> draft id (valid where t2d)
    valid = teacher_ids >= 0
    ids = teacher_ids.clamp(min=0)
    in_draft = valid & t2d[ids]
    p = torch.where(in_draft, teacher_logprobs.exp(), torch.zeros((), dtype=torch.float32))
    total = p.sum(-1, keepdim=True)
    target = torch.zeros((*teacher_ids.shape[:-1], int(t2d.sum())), dtype=torch.float32)
    target.scatter_add_(-1, torch.where(in_draft, draft_index[ids], 0), p / total.clamp(min=1e-30))
    position_mask = valid[..., 0] & t2d[ids[..., 0]]
    return target, position_mask, total.squeeze(-1)
