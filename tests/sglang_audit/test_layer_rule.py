"""hs_dataset.capture.layer_ids against SGLang's own ``set_eagle3_layers_to_capture`` of every kept release (0.5.11 to
0.5.23, the excerpts in releases/): the ids hs_dataset puts in a drafter config make SGLang capture the entries of
layers k + 1, i.e. the outputs of hs_dataset's layers k, per model file and release."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace
from typing import List, Optional

import pytest

from hs_dataset.capture.layer_ids import sglang_ids
from tests.sglang_audit.touchpoints import RELEASES, load_release

ARCH = {"llama": "LlamaForCausalLM", "deepseek_v2": "DeepseekV3ForCausalLM",
        "glm4_moe_lite": "Glm4MoeLiteForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
L = 12
LAYER_SETS = ([1, 5, 9], [2, 5, 9], [0, 4, 10], [3])
VERSIONS = sorted((p.stem for p in RELEASES.glob("*.json")), key=lambda v: tuple(map(int, v.split("."))))


def sglang_positions(code: str, ids: list[int]) -> list[int]:
    """Run SGLang's ``set_eagle3_layers_to_capture`` (its source, as released) on a model of L layers."""
    ns: dict = {"Optional": Optional, "List": List}
    exec(textwrap.dedent(code), ns)  # noqa: S102 - SGLang's own method, from the release's excerpt
    inner = SimpleNamespace(layers_to_capture=[])
    inner.set_eagle3_layers_to_capture = lambda positions: setattr(inner, "layers_to_capture", list(positions))
    model = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True), config=SimpleNamespace(num_hidden_layers=L),
                            model=inner, capture_aux_hidden_states=False)
    ns["set_eagle3_layers_to_capture"](model, ids)
    assert model.capture_aux_hidden_states is True
    return list(inner.layers_to_capture)


@pytest.mark.parametrize("version", VERSIONS)
def test_the_drafter_ids_make_sglang_capture_the_recorded_layers(version):
    release = load_release(version)
    checked = 0
    for f, arch in ARCH.items():
        found = release["touchpoints"][f"set_eagle3.{f}"]
        if found == "absent":
            continue
        for ks in LAYER_SETS:
            ids, rule = sglang_ids(arch, L, ks, sglang_version=version)
            if ids is None:
                assert arch in ("DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM") and ks[0] == 0, rule
                continue
            assert sglang_positions(found["text"], ids) == [k + 1 for k in ks], (version, f, ks, ids, rule)
            checked += 1
    assert checked >= 20


def test_the_old_deepseek_rule_is_caught_without_the_release():
    """0.5.12's deepseek_v2.py adds 1 to every id: the ids of the 0.5.13+ rule would capture layer k+1 there."""
    code = load_release("0.5.12")["touchpoints"]["set_eagle3.deepseek_v2"]["text"]
    ids, _ = sglang_ids("DeepseekV3ForCausalLM", L, [1, 5, 9])
    assert sglang_positions(code, ids) == [2, 6, 10]  # right with the new rule's ids: first id 1
    ids, _ = sglang_ids("DeepseekV3ForCausalLM", L, [2, 5, 9])
    assert sglang_positions(code, ids) == [4, 7, 11]  # off by one: the outputs of layers 3, 6, 10
