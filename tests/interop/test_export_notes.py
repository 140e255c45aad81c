"""Exports say what they do with what the peer cannot hold: an fp8 build goes to speculators in hs-connectors' FP8
layout (read back by speculators' own reader), and teacher top-k columns are named as not exported."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from hs_dataset.interop import export_dataset, export_speculators
from tests.fixtures.interop import PRE_LAYERS, build_tiny, rows


def test_an_fp8_build_is_exported_to_speculators_in_its_fp8_layout(tiny_norm_model, tmp_path):
    hs_connectors = pytest.importorskip("hs_connectors", reason="the peers' packages are not installed")
    fp8 = build_tiny(tiny_norm_model, tmp_path / "fp8", layers=PRE_LAYERS, storage_dtype="fp8_e4m3")
    s = export_speculators(fp8, tmp_path / "spec")
    assert any(w.startswith("fp8 build: written in hs-connectors' FP8 layout") for w in s.warnings), s.warnings
    with safe_open(str(tmp_path / "spec" / "hidden_states" / "hs_0.safetensors"), "pt") as f:
        assert f.get_tensor("hidden_states").dtype == torch.float8_e4m3fn
        assert f.get_tensor("hidden_states_scales").dtype == torch.float32
    theirs = hs_connectors.FP8Transfer(tmp_path / "spec" / "hidden_states")
    for i, row in enumerate(rows(fp8)):
        hs = theirs.get_cached(i)["hidden_states"]  # dequantized by speculators' reader
        for j, k in enumerate(PRE_LAYERS):
            ref = row[f"hidden_layer_{k}"].float()
            token_max = torch.stack([row[f"hidden_layer_{m}"].float().abs().amax(-1) for m in PRE_LAYERS]).amax(0)
            # e4m3 rounds by at most 2^-4 of the token's largest value (its scale's grid), twice: ours, theirs
            assert ((hs[:, j].float() - ref).abs() <= token_max[:, None] / 8 + 1e-6).all(), (i, k)


def test_teacher_columns_are_named_as_not_exported(tiny_model, tmp_path):
    teacher = build_tiny(tiny_model, tmp_path / "t", teacher="topk:4")
    for fmt in ("specforge", "modelopt"):
        s = export_dataset(teacher, fmt, tmp_path / fmt)
        notes = [w for w in s.warnings if "teacher top-4 columns" in w]
        assert len(notes) == 1 and "not exported" in notes[0] and "\n" not in notes[0], s.warnings
