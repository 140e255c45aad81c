"""The transformers backend's chunked prefill (``prefill_chunk``, the long-context reference): a sample run
``chunk`` positions at a time over a KV cache gives the states of the same sample run in one pass, for a
Llama and for a DeepSeek-V3 with YaRN positions (MLA: keys and values of different widths)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hs_dataset.capture.transformers import TransformersBackend
from hs_dataset.records import TokenizedSample


def _tiny_deepseek_v3(path) -> str:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, max_position_embeddings=512,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0})
    DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_a_chunked_prefill_gives_the_states_of_one_pass(arch, tiny_model, tmp_path):
    model = tiny_model if arch == "llama" else _tiny_deepseek_v3(tmp_path / "ds")
    rng = np.random.default_rng(0)
    T = 300  # 4 passes of 80 positions, the last one short
    sample = TokenizedSample("long", rng.integers(3, 250, size=T).astype(np.int32), np.ones(T, np.uint8))
    whole = TransformersBackend(model, [0, 1], device="cpu")
    (want,) = list(whole.capture([sample]))
    whole.close()
    chunked = TransformersBackend(model, [0, 1], device="cpu", prefill_chunk=80)
    (got,) = list(chunked.capture([sample]))
    chunked.close()
    assert got.states.shape == want.states.shape == (3, T, 64)
    a, b = got.states.float(), want.states.float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    assert float(cos.min()) > 0.999, float(cos.min())  # bf16 weights and states: rounding, not a wrong position
    assert float((a - b).norm() / b.norm()) < 0.01
