"""The model's final norm, applied on the CPU to a pre-norm last-layer state to give ``hidden_final``.

vLLM (and so speculators, and ModelOpt's vLLM dumps) store the last layer's output *before* the
final norm; hs_dataset stores that as ``hidden_layer_{L-1}`` and computes ``hidden_final`` from it
only with the model's own norm weight and epsilon, with the arithmetic of HF transformers'
``LlamaRMSNorm`` (float32 normalisation, cast back to bf16, then times the bf16 weight), which is
bit-identical to what the transformers backend stores as ``hidden_final``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

from hs_dataset.errors import InteropError

__all__ = ["RMSNORM_MODEL_TYPES", "FinalNorm", "load_final_norm"]

# model_type values whose final norm is HF's LlamaRMSNorm arithmetic (checked against transformers 5).
RMSNORM_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "deepseek_v2", "deepseek_v3",
    "kimi_k2", "phi3", "glm4", "glm4_moe", "minimax", "granite",
})
_WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors")


@dataclass(frozen=True)
class FinalNorm:
    """RMSNorm with the model's final-norm ``weight`` (bf16 ``[H]``) and ``eps``."""

    weight: torch.Tensor
    eps: float
    tensor_name: str
    model_type: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` bf16 ``[T, H]`` (before the norm) -> bf16 ``[T, H]`` after it."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def describe(self, layer: int) -> str:
        """What ``hidden_final`` is, for the metadata (``layer``: the pre-norm last layer, ``L-1``)."""
        return (f"hidden_final = RMSNorm(hidden_layer_{layer}) computed by hs_dataset with {self.tensor_name} "
                f"(eps {self.eps}, {self.model_type}, HF LlamaRMSNorm arithmetic)")


def _norm_tensor_name(names: list[str], where: str) -> str:
    hits = [n for n in names if n == "model.norm.weight" or n.endswith(".model.norm.weight")]
    if len(hits) != 1:
        raise InteropError(f"{where}: expected one final norm weight named model.norm.weight, found {hits or 'none'}")
    return hits[0]


def load_final_norm(model_dir: str | os.PathLike, why: str) -> FinalNorm:
    """Read the final norm's weight (one tensor: the rest of the weights stays on disk) and epsilon.

    ``why`` says what needs it (for the error message). Raises :class:`InteropError` when the
    directory has no weights, or the model's norm is not a plain RMSNorm.
    """

    model_dir = str(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    model_type = str(text.get("model_type", cfg.get("model_type", "")))
    if model_type not in RMSNORM_MODEL_TYPES:
        raise InteropError(f"{why}; hs_dataset computes it only for models whose final norm is a plain RMSNorm "
                           f"({', '.join(sorted(RMSNORM_MODEL_TYPES))}), not model_type {model_type!r}")
    eps = text.get("rms_norm_eps")
    if eps is None:
        raise InteropError(f"{model_dir}/config.json has no rms_norm_eps: cannot compute the final norm")
    index = os.path.join(model_dir, _WEIGHT_FILES[0])
    single = os.path.join(model_dir, _WEIGHT_FILES[1])
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        name = _norm_tensor_name(list(weight_map), index)
        path = os.path.join(model_dir, weight_map[name])
    elif os.path.exists(single):
        with safe_open(single, framework="pt") as st:
            name = _norm_tensor_name(list(st.keys()), single)
        path = single
    else:
        raise InteropError(f"{why}: pass --model with the model's weights ({' or '.join(_WEIGHT_FILES)} holding "
                           f"model.norm.weight; only that tensor is read), {model_dir} has none")
    with safe_open(path, framework="pt") as st:
        weight = st.get_tensor(name).to(torch.bfloat16)
    return FinalNorm(weight, float(eps), name, model_type)
