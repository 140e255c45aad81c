"""Random-weight checkpoints that SGLang 0.5.17 loads, in the shapes whose kernels the device's
kernel cache covers (adapted from the team's verified GPU recipe). Made locally, no downloads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

try:
    import sglang  # noqa: F401

    HAVE_SGLANG = True
except Exception:  # pragma: no cover - CPU machines
    HAVE_SGLANG = False

# every GPU test module's marks: ``pytest -m gpu`` selects them, a CPU machine skips them with the reason
GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not HAVE_SGLANG,
                       reason="needs a CUDA GPU and SGLang 0.5.14 - 0.5.23 (run on the device: see README)"),
]


def make_llama(out: str | Path, *, hidden=512, layers=8, heads=8, kv_heads=4, inter=1536, vocab=32000, seed=0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def make_dsv3(out: str | Path, seed=0, *, hidden=512, vocab=32000) -> Path:
    """DeepSeek-V3 style (MLA + MoE, 4 layers, the first dense) with the official tensor names."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config

    out = Path(out)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    H, V, L = hidden, vocab, 4
    nh, qlr, kvlr, nope, rope, vd = 8, 256, 512, 128, 64, 128
    inter, moe_inter, E, shared = 1024, 256, 8, 1
    cfg = DeepseekV3Config(
        vocab_size=V, hidden_size=H, intermediate_size=inter, moe_intermediate_size=moe_inter,
        num_hidden_layers=L, num_attention_heads=nh, num_key_value_heads=nh,
        n_shared_experts=shared, n_routed_experts=E, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        q_lora_rank=qlr, kv_lora_rank=kvlr, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=vd, max_position_embeddings=4096, rope_scaling=None,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    d = cfg.to_dict()
    d["architectures"] = ["DeepseekV3ForCausalLM"]
    d["torch_dtype"] = d["dtype"] = "bfloat16"
    d.setdefault("topk_method", "noaux_tc")
    d.setdefault("scoring_func", "sigmoid")
    d.setdefault("norm_topk_prob", True)
    d["num_nextn_predict_layers"] = 0
    d.update(moe_layer_freq=1, ep_size=1, aux_loss_alpha=0.001, seq_aux=True)  # read by sglang's deepseek_v2.py
    os.makedirs(out, exist_ok=True)
    bf = torch.bfloat16
    r = lambda *s: (torch.randn(*s) * 0.02).to(bf)  # noqa: E731
    one = lambda n: torch.ones(n, dtype=bf)  # noqa: E731
    sd = {"model.embed_tokens.weight": r(V, H), "model.norm.weight": one(H), "lm_head.weight": r(V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        sd.update({
            p + "input_layernorm.weight": one(H), p + "post_attention_layernorm.weight": one(H),
            p + "self_attn.q_a_proj.weight": r(qlr, H), p + "self_attn.q_a_layernorm.weight": one(qlr),
            p + "self_attn.q_b_proj.weight": r(nh * (nope + rope), qlr),
            p + "self_attn.kv_a_proj_with_mqa.weight": r(kvlr + rope, H),
            p + "self_attn.kv_a_layernorm.weight": one(kvlr),
            p + "self_attn.kv_b_proj.weight": r(nh * (nope + vd), kvlr),
            p + "self_attn.o_proj.weight": r(H, nh * vd),
        })
        if i < cfg.first_k_dense_replace:
            sd.update({p + "mlp.gate_proj.weight": r(inter, H), p + "mlp.up_proj.weight": r(inter, H),
                       p + "mlp.down_proj.weight": r(H, inter)})
        else:
            sd[p + "mlp.gate.weight"] = r(E, H)
            sd[p + "mlp.gate.e_score_correction_bias"] = torch.zeros(E, dtype=torch.float32)
            for e in range(E):
                q = p + f"mlp.experts.{e}."
                sd.update({q + "gate_proj.weight": r(moe_inter, H), q + "up_proj.weight": r(moe_inter, H),
                           q + "down_proj.weight": r(H, moe_inter)})
            si = shared * moe_inter
            sd.update({p + "mlp.shared_experts.gate_proj.weight": r(si, H),
                       p + "mlp.shared_experts.up_proj.weight": r(si, H),
                       p + "mlp.shared_experts.down_proj.weight": r(H, si)})
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(d, indent=1))
    return out


def make_kimi_k25(out: str | Path, seed=0, *, hidden=512, vocab=32000) -> Path:
    """Kimi-K2.5 as it ships and SGLang loads it, tiny: ``KimiK25ForConditionalGeneration`` (model_type
    ``kimi_k25``) with the tiny DeepSeek-V3 of :func:`make_dsv3` as ``text_config`` and a one-block
    MoonViT vision tower; weights under the checkpoint's names (``language_model.*``, ``vision_tower.*``,
    ``mm_projector.*``), the language-model tensors exactly :func:`make_dsv3`'s; the tokenizer and
    processor packaged like Kimi's (tiktoken + remote code: :func:`hs_dataset.demo.tiny_kimi.make_kimi_tokenizer`),
    so loading it needs ``trust_remote_code``."""
    from safetensors.torch import load_file, save_file

    from hs_dataset.demo.tiny_kimi import make_kimi_tokenizer

    out = Path(out)
    if (out / "config.json").exists():
        return out
    text_dir = make_dsv3(out.parent / f".{out.name}-text", seed=seed, hidden=hidden, vocab=vocab)
    text_cfg = json.loads((text_dir / "config.json").read_text())
    # text_config keeps "architectures": SGLang's DeepseekV2ForCausalLM.determine_num_fused_shared_experts
    # (models/deepseek_v2.py, 0.5.17) reads config.architectures[0] of the config it is built from, here text_config.
    text_cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    vt, mlp, patch, merge = 64, 128, 14, (2, 2)
    vision = dict(patch_size=patch, init_pos_emb_height=8, init_pos_emb_width=8, init_pos_emb_time=4,
                  pos_emb_type="divided_fixed", num_attention_heads=2, num_hidden_layers=1, hidden_size=vt,
                  intermediate_size=mlp, merge_kernel_size=list(merge), video_attn_type="spatial_temporal",
                  merge_type="sd2_tpool", mm_projector_type="patchmerger", mm_hidden_size=vt, vt_hidden_size=vt,
                  projector_hidden_act="gelu", projector_ln_eps=1e-5, text_hidden_size=text_cfg["hidden_size"])
    tok_dir = make_kimi_tokenizer(out)
    tok_cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    token_id = {v["content"]: int(k) for k, v in tok_cfg["added_tokens_decoder"].items()}
    if max(token_id.values()) >= vocab:
        raise ValueError(f"vocab={vocab} is smaller than the tiny Kimi tokenizer ({max(token_id.values()) + 1} ids)")
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text_cfg,
           "vision_config": vision, "media_placeholder_token_id": token_id["<|media_pad|>"],
           "pad_token_id": token_id["[PAD]"], "bos_token_id": token_id["[BOS]"], "eos_token_id": token_id["[EOS]"],
           "torch_dtype": "bfloat16", "dtype": "bfloat16", "tie_word_embeddings": False}
    torch.manual_seed(seed + 1)
    bf = torch.bfloat16
    r = lambda *s: (torch.randn(*s) * 0.02).to(bf)  # noqa: E731
    sd = {f"language_model.{k}": v for k, v in load_file(str(text_dir / "model.safetensors")).items()}
    v = "vision_tower."
    sd.update({v + "patch_embed.proj.weight": r(vt, 3, patch, patch), v + "patch_embed.proj.bias": r(vt),
               v + "patch_embed.pos_emb.weight": r(8, 8, vt),
               v + "encoder.final_layernorm.weight": torch.ones(vt, dtype=bf),
               v + "encoder.final_layernorm.bias": torch.zeros(vt, dtype=bf)})
    b = v + "encoder.blocks.0."
    sd.update({b + "norm0.weight": torch.ones(vt, dtype=bf), b + "norm0.bias": torch.zeros(vt, dtype=bf),
               b + "norm1.weight": torch.ones(vt, dtype=bf), b + "norm1.bias": torch.zeros(vt, dtype=bf),
               b + "wqkv.weight": r(3 * vt, vt), b + "wqkv.bias": r(3 * vt), b + "wo.weight": r(vt, vt),
               b + "wo.bias": r(vt), b + "mlp.fc0.weight": r(mlp, vt), b + "mlp.fc0.bias": r(mlp),
               b + "mlp.fc1.weight": r(vt, mlp), b + "mlp.fc1.bias": r(vt)})
    m, merged = "mm_projector.", vt * merge[0] * merge[1]
    sd.update({m + "pre_norm.weight": torch.ones(vt, dtype=bf), m + "pre_norm.bias": torch.zeros(vt, dtype=bf),
               m + "proj.0.weight": r(merged, merged), m + "proj.0.bias": r(merged),
               m + "proj.2.weight": r(text_cfg["hidden_size"], merged), m + "proj.2.bias": r(text_cfg["hidden_size"])})
    os.makedirs(out, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))  # last: the directory is complete
    return out


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """The tiny Llama, DeepSeek-V3 and Kimi-K2.5 checkpoints the GPU tests run, made once per session (on the GPU)."""
    root = tmp_path_factory.mktemp("models")
    return {"llama": str(make_llama(root / "tiny-llama")), "dsv3": str(make_dsv3(root / "tiny-dsv3")),
            "kimi": str(make_kimi_k25(root / "tiny-kimi-k25"))}
