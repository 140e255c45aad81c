"""CPU checks of the SGLang plugin's refusals (the capture itself runs in tests/test_sglang_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hs_dataset import sglang_plugin
from hs_dataset.spool import PLUGIN_ERROR


def test_dp_attention_is_refused_with_a_message_the_backend_shows(tmp_path, monkeypatch):
    monkeypatch.setattr(sglang_plugin.S, "config", {"layers": [1], "spool": str(tmp_path), "rid_prefix": "hsds-"})
    model = SimpleNamespace(capture_aux_hidden_states=False, model=SimpleNamespace(layers_to_capture=[], layers=[0] * 4))
    runner = SimpleNamespace(model=model, server_args=SimpleNamespace(enable_dp_attention=True))
    with pytest.raises(RuntimeError, match="DP attention"):
        sglang_plugin._after_load_model(None, runner)
    assert "--enable-dp-attention" in (tmp_path / PLUGIN_ERROR).read_text()  # what SGLangBackend raises with
    assert model.capture_aux_hidden_states is False  # nothing was switched on
