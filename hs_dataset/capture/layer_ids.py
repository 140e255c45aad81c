"""The layer ids a drafter config needs, per serving engine, for layers in hs_dataset's convention.

hs_dataset's ``layer k`` is the output of decoder layer k (see :mod:`hs_dataset.model_info`).
The engines name the same state differently:

vLLM (``EagleModelMixin._maybe_add_hidden_state`` in ``vllm/model_executor/models/interfaces.py``)
    ``eagle_aux_hidden_state_layer_ids`` = ids of the decoder layer whose **input** is captured,
    for every model class; id ``L`` (``num_hidden_layers``) is the last layer's output before the
    final norm. So vLLM id = ``k + 1`` (speculators' ``--target-layer-ids`` are these ids).

SGLang 0.5.17 (``set_eagle3_layers_to_capture`` in ``sglang/srt/models/*.py``, fed from the draft
config's ``eagle_config.eagle_aux_hidden_state_layer_ids``; SpecForge passes its
``aux_hidden_state_layer_ids`` to the same method)
    captures the input of layer ``p`` for each capture position ``p``. Most classes
    (``llama.py`` ~line 885: Llama, Qwen2/3, Qwen-MoE, Gemma3, GLM-4-MoE, GPT-OSS, MiniMax...) set
    ``p = id + 1``, so SGLang id = ``k``. The DeepSeek-V2 family (``deepseek_v2.py`` ~line 3134:
    DeepSeek-V2/V3/V3.2, Kimi-K2/K2.5, Mistral-Large-3, GLM-MoE-DSA; and ``glm4_moe_lite.py``)
    sets ``p = id + 1`` only when the first id is 1, else ``p = id``: there SGLang id = ``k``
    when the first k is 1, and ``k + 1`` when the first k is 2 or more; a first k of 0 cannot be
    expressed. SGLang never captures the last layer's output (``p = L`` is past its loop), so
    ``k = L - 1`` has no SGLang id.

    Per release (read in every release's source: tests/sglang_audit): the rules above hold from 0.5.13 through
    0.5.23. In 0.5.11-0.5.12 ``deepseek_v2.py`` added 1 to every id (``sglang_ids(..., sglang_version=)``).
    GPT-OSS (0.5.17+) keeps ids as given when the largest is ``num_hidden_layers``: hs_dataset never emits
    that id, so its +1 rule holds.

ModelOpt's HF dumper (``compute_hidden_states_hf.py``: ``hidden_states[lid + 1]``) and its
``eagle_aux_hidden_state_layer_ids`` training option use ``k`` itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["SGLANG_FIRST_ID_RULE", "SGLANG_FIRST_ID_RULE_SINCE", "drafter_layer_ids", "sglang_ids", "vllm_ids"]

# Architectures (config.json "architectures"[0]) whose SGLang class applies deepseek_v2.py's
# "+1 only when the first id is 1" rule (SGLang 0.5.17).
SGLANG_FIRST_ID_RULE = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "MistralLarge3ForCausalLM",
    "GlmMoeDsaForCausalLM", "Glm4MoeLiteForCausalLM", "KimiK25ForConditionalGeneration",
})


SGLANG_FIRST_ID_RULE_SINCE = (0, 5, 13)  # before: deepseek_v2.py added 1 to every id


def vllm_ids(layers: Iterable[int]) -> list[int]:
    """vLLM's ``eagle_aux_hidden_state_layer_ids`` for hs_dataset layers (every model class)."""
    return [int(k) + 1 for k in layers]


def sglang_ids(architecture: str, num_layers: int, layers: Iterable[int],
               sglang_version: str | None = None) -> tuple[list[int] | None, str]:
    """SGLang's ``eagle_aux_hidden_state_layer_ids`` for hs_dataset layers, with the rule applied.

    Args:
        sglang_version: the SGLang that will serve the drafter (None: 0.5.13 or newer).

    Returns ``(ids, rule)``; ``ids`` is None when SGLang cannot capture these layers (``rule``
    then says why).
    """
    ks = [int(k) for k in layers]
    if any(k >= num_layers - 1 for k in ks):
        return None, (f"layer {num_layers - 1} (the last layer's output before the final norm) has no SGLang id: "
                      "SGLang captures only the inputs of decoder layers")
    old = sglang_version is not None and _version(sglang_version) < SGLANG_FIRST_ID_RULE_SINCE
    if architecture in SGLANG_FIRST_ID_RULE and old:
        return ks, f"{architecture}: SGLang {sglang_version} adds 1 to every id (deepseek_v2.py before 0.5.13)"
    if architecture in SGLANG_FIRST_ID_RULE:
        rule = f"{architecture}: SGLang adds 1 to every id only when the first id is 1 (deepseek_v2.py)"
        if ks and ks[0] == 0:
            return None, rule + "; a first layer of 0 cannot be expressed"
        return (ks if ks and ks[0] == 1 else [k + 1 for k in ks]), rule
    return ks, f"{architecture}: SGLang adds 1 to every id (llama.py rule)"


def _version(v: str) -> tuple[int, ...]:
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in v.split(".")[:3])


def drafter_layer_ids(architecture: str, num_layers: int, aux: Iterable[int]) -> dict[str, Any]:
    """What to put in the drafter config for the aux layers ``aux`` (hs_dataset convention)."""
    aux = [int(k) for k in aux]
    sg, rule = sglang_ids(architecture, num_layers, aux)
    return {
        "hs_dataset_layers": aux,
        "layer_convention": "hs_dataset layer k = output of decoder layer k (0-based), before the final norm",
        "architecture": architecture,
        "num_hidden_layers": num_layers,
        "vllm": {"eagle_aux_hidden_state_layer_ids": vllm_ids(aux),
                 "rule": "vLLM captures the input of layer id: id = k + 1 (speculators --target-layer-ids)"},
        "sglang": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": sg}, "rule": rule},
        "specforge": {"aux_hidden_state_layer_ids": sg,
                      "rule": "SpecForge passes these to SGLang's set_eagle3_layers_to_capture: the SGLang ids"},
        "modelopt": {"eagle_aux_hidden_state_layer_ids": aux,
                     "rule": "ModelOpt's HF dump and training config use k itself"},
    }
