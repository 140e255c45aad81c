"""CPU checks of the SGLang plugin's model lookup and refusals (the capture itself runs in
tests/gpu/test_sglang.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hs_dataset.capture.sglang import plugin as sglang_plugin
from hs_dataset.capture.transport import PLUGIN_ERROR


def _text_model():
    return SimpleNamespace(capture_aux_hidden_states=False, model=SimpleNamespace(layers_to_capture=[], layers=[0] * 4))


def test_dp_attention_is_refused_with_a_message_the_backend_shows(tmp_path, monkeypatch):
    monkeypatch.setattr(sglang_plugin.S, "config", {"layers": [1], "dir": str(tmp_path), "rid_prefix": "hsds-"})
    model = _text_model()
    runner = SimpleNamespace(model=model, server_args=SimpleNamespace(enable_dp_attention=True))
    with pytest.raises(RuntimeError, match="DP attention"):
        sglang_plugin._after_load_model(None, runner)
    assert "--enable-dp-attention" in (tmp_path / PLUGIN_ERROR).read_text()  # what SGLangBackend raises with
    assert model.capture_aux_hidden_states is False  # nothing was switched on


def test_prefill_cuda_graphs_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sglang_plugin.S, "config", {"layers": [1], "dir": str(tmp_path), "rid_prefix": "hsds-"})
    graphs = SimpleNamespace(prefill=SimpleNamespace(backend="breakable"))
    runner = SimpleNamespace(model=_text_model(), server_args=SimpleNamespace(cuda_graph_config=graphs))
    with pytest.raises(RuntimeError, match="--cuda-graph-backend-prefill disabled"):
        sglang_plugin._after_load_model(None, runner)


def test_the_text_model_is_found_inside_a_multimodal_wrapper():
    """Kimi-K2.5's KimiK25ForConditionalGeneration keeps a DeepseekV3ForCausalLM as language_model
    (and aliases .model to it); the capture switches live on that text model."""
    text = _text_model()
    wrapper = SimpleNamespace(vision_tower=object(), language_model=text, model=text)
    assert sglang_plugin.find_text_model(wrapper) is text
    assert sglang_plugin.find_text_model(text) is text
    with pytest.raises(RuntimeError, match="no EAGLE-3 aux hidden-state capture.*language_model"):
        sglang_plugin.find_text_model(SimpleNamespace(model=SimpleNamespace()))
