"""Stored states against the reference backend's, and what a mismatch is: the comparisons of the probe.

Per state column of a row (``[T, H]``, stored vs recomputed), as the GPU parity suite
(``tests/gpu/test_sglang.py``) measures: the mean token cosine, the smallest token cosine and the
relative error ``mean |stored - ref| / mean |ref|``. A column matches when it meets its storage dtype's
:data:`THRESHOLDS`:

========== ================ ============== ====================
storage    mean cosine >=   rel. error <=  every token cos >=
========== ================ ============== ====================
bfloat16   0.97             0.12           0.3
fp8_e4m3   0.965            0.15           0.3
========== ================ ============== ====================

Why: another engine (SGLang's fused kernels, Triton attention, MoE kernels) on the same bf16 weights
differs by bf16 rounding accumulated over the layers, and more the wider the model: on the H200 the tiny
Llama and DeepSeek-V3 (hidden 512) gave 0.9996-0.99997 mean cosine and 0.65-1.08% error; the Kimi-width
stand-in (DeepSeek-V3 at hidden 7168, 6 layers, random weights; 64 rows of 1,024 tokens built through
SGLang, ``tests/gpu/test_probe.py``) 0.985-0.999 and 1.6-7.1%, growing with depth, single tokens down
to 0.59 where rounding flips an expert (random routers are near ties). fp8 e4m3 adds its 3-bit mantissa
(the tiny test model on the CPU, fp8 stored against the bf16 reference: 0.99965 mean cosine, 2.3% error).
A state of another sample, shifted by a token, zeroed (prompt positions a radix cache skipped) or NaN
is far outside: cosines near 0, errors near or above 100% (the tests' faults: 0.86 and 64% for an fp8
column clamped at 448; the adjacent layer's state 46-90% on the tiny models). What these bounds let
through: a deep model's adjacent layer may lie within 12% of the asked one; the layer convention is
pinned by the GPU parity suite, not by the probe.

A column that does not match is tested against its neighbours (:func:`explain`): the reference
shifted by one token either way (a state written one position off), and other probed samples'
references over their common prefix (a state attributed to the wrong request).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

__all__ = ["THRESHOLDS", "Parity", "Thresholds", "compare", "explain_shift"]


@dataclass(frozen=True)
class Thresholds:
    """What a matching column meets (see the module docstring)."""

    mean_cos: float
    rel_err: float
    token_cos: float = 0.3

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


THRESHOLDS = {"bfloat16": Thresholds(0.97, 0.12, 0.3), "fp8_e4m3": Thresholds(0.965, 0.15, 0.3)}


@dataclass(frozen=True)
class Parity:
    """One column of one row against its reference."""

    mean_cos: float
    min_cos: float
    rel_err: float
    bad_tokens: int  # tokens whose cosine is below the threshold's token_cos
    first_bad: int  # the first of them (-1: none)
    nonfinite: int  # NaN/Inf values stored

    def ok(self, th: Thresholds) -> bool:
        return (not self.nonfinite and self.mean_cos >= th.mean_cos and self.rel_err <= th.rel_err
                and self.bad_tokens == 0)

    def to_dict(self) -> dict[str, float]:
        return {"mean_cos": round(self.mean_cos, 6), "min_cos": round(self.min_cos, 6),
                "rel_err": round(self.rel_err, 6)}

    def what(self, th: Thresholds) -> str:
        """Why it does not match, in words."""
        if self.nonfinite:
            return f"{self.nonfinite:,} NaN/Inf values"
        if self.mean_cos >= th.mean_cos and self.rel_err <= th.rel_err:
            return (f"{self.bad_tokens} token(s) from position {self.first_bad} differ (cosine < {th.token_cos}; "
                    f"lowest {self.min_cos:.3f}): positions not computed for it (a prefix cache?)")
        return f"mean cosine {self.mean_cos:.4f}, relative error {self.rel_err:.1%}"


def compare(stored: torch.Tensor, ref: torch.Tensor, th: Thresholds) -> Parity:
    """``stored`` against ``ref`` (both ``[T, H]``, any float dtype; T may be 0)."""
    g, r = stored.float(), ref.float()
    bad_values = int((~torch.isfinite(g)).sum())
    if g.shape[0] == 0:
        return Parity(1.0, 1.0, 0.0, 0, -1, bad_values)
    if bad_values:
        g = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
    cos = torch.nn.functional.cosine_similarity(g, r, dim=-1)
    low = (cos < th.token_cos).nonzero()
    denom = float(r.abs().mean())
    rel = float((g - r).abs().mean()) / denom if denom else float((g - r).abs().mean())
    return Parity(float(cos.mean()), float(cos.min()), rel, int(low.numel()), int(low[0, 0]) if low.numel() else -1,
                  bad_values)


def explain_shift(stored: torch.Tensor, ref: torch.Tensor, th: Thresholds) -> int:
    """+1 when ``stored[t]`` matches ``ref[t + 1]``, -1 when it matches ``ref[t - 1]``, 0 when neither
    (compared over the ``T - 1`` positions both have; rows of fewer than 3 tokens are never shifted)."""
    if stored.shape[0] < 3:
        return 0
    if compare(stored[:-1], ref[1:], th).ok(th):
        return 1
    if compare(stored[1:], ref[:-1], th).ok(th):
        return -1
    return 0
