"""The start-up self-check's comparison (hs_dataset.capture.selfcheck) on the transformers backend's model: the
reference forward hooks the SGLang plugin runs in the scheduler, on real decoder layers, against the backend's own
capture of the same pass; a deliberately shifted capture is caught with one line naming the layer really captured.
The same check against real SGLang runs in tests/gpu/test_selfcheck.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hs_dataset.capture.selfcheck import (FINAL, ReferenceHooks, SelfCheckError, check_capture, layer_output,
                                          residual_sum, selfcheck_file, warmup_ids)
from hs_dataset.capture.transformers import TransformersBackend
from hs_dataset.records import TokenizedSample


def _warmup(vocab: int) -> TokenizedSample:
    ids = warmup_ids(vocab)
    return TokenizedSample("warm-up", np.array(ids, dtype=np.int32), np.ones(len(ids), np.uint8))


def _capture_with_reference(model: str, layers: tuple[int, ...]):
    be = TransformersBackend(model, layers, device="cpu")
    hooks = ReferenceHooks(list(be._model.layers), be._model.norm)
    try:
        (r,) = list(be.capture([_warmup(be.info.vocab_size)]))
    finally:
        hooks.remove()
        be.close()
    return r, hooks.cpu()


def test_the_capture_equals_the_decoder_layers_outputs_exactly(tiny_model):
    r, ref = _capture_with_reference(tiny_model, (0, 1, 3))
    assert sorted(ref) == ["final", "layer_0", "layer_1", "layer_2", "layer_3"]  # every layer, not only the captured
    captured = {k: r.layer(k) for k in (0, 1, 3)} | {FINAL: r.final}
    line = check_capture("transformers", captured, ref)
    assert line.startswith("passed: layer 0, layer 1, layer 3, final equal") and "24-token" in line


def test_a_capture_shifted_by_one_layer_is_caught_with_one_line(tiny_model):
    r, ref = _capture_with_reference(tiny_model, (1, 2, 3))
    shifted = {0: r.layer(1), 1: r.layer(2), 2: r.layer(3), FINAL: r.final}  # layer k+1's output recorded as layer k
    with pytest.raises(SelfCheckError) as e:
        check_capture("SGLang 9.9.9", shifted, ref)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("SGLang 9.9.9 captured the output of layer 1 where hs_dataset records layer 0: ")


def test_the_last_layer_recorded_as_hidden_final_is_caught(tiny_model):
    """The off-by-one the peers shipped: the last layer's pre-norm output stored as the final (post-norm) state."""
    r, ref = _capture_with_reference(tiny_model, (3,))
    with pytest.raises(SelfCheckError, match=r"captured the output of layer 3 \(before the final norm\) where "
                                             r"hs_dataset records hidden_final \(the final norm's output\)"):
        check_capture("SGLang 9.9.9", {3: r.layer(3), FINAL: r.layer(3)}, ref)


def test_a_state_that_equals_no_layer_is_named_with_its_nearest(tiny_model):
    r, ref = _capture_with_reference(tiny_model, (2,))
    off = r.layer(2).clone()
    off[5, 7] += 1.0  # one value changed: a copy from a reused buffer would look like this
    with pytest.raises(SelfCheckError, match=r"recorded as layer 2 a state that equals no decoder layer's output "
                                             r"\(1 of \d+ values differ, max by [0-9.]+; nearest: layer 2\)"):
        check_capture("SGLang 9.9.9", {2: off}, ref)


def test_hooks_that_did_not_run_are_an_error_not_a_pass(tiny_model):
    r, ref = _capture_with_reference(tiny_model, (2,))
    with pytest.raises(SelfCheckError, match="saw no layer 2 .*unchecked"):
        check_capture("SGLang 9.9.9", {2: r.layer(2)}, {k: v for k, v in ref.items() if k != "layer_2"})


def test_sglang_layers_output_is_hidden_plus_residual():
    """SGLang's decoder layers (up to 0.5.20) return (hidden, residual[, topk]) with the residual add deferred to the
    next fused add-RMSNorm: the layer's output is the sum (the state SGLang's aux capture appends at the next layer)."""
    h, res = torch.randn(6, 4, dtype=torch.bfloat16), torch.randn(6, 4, dtype=torch.bfloat16)
    assert torch.equal(residual_sum((h, res, None)), h + res)
    assert torch.equal(residual_sum((h, None)), h)
    assert torch.equal(layer_output((h, res)), h)
    assert torch.equal(residual_sum(h), h)


def test_the_plugins_hooks_keep_the_rows_of_the_self_check_request(tiny_model, tmp_path, monkeypatch):
    """The plugin's own functions, on the transformers model's real layers: only a ring whose builder wrote the
    .want file gets hooks, once; they keep that request's rows of the batched pass, saved where the builder
    reads them; and they equal what the backend captured for the same prompt."""
    from hs_dataset.capture.sglang import plugin as sglang_plugin

    be = TransformersBackend(tiny_model, (1, 3), device="cpu")
    monkeypatch.setattr(sglang_plugin.S, "config", {"layers": [1, 3], "dir": str(tmp_path), "rid_prefix": "hsds-"})
    monkeypatch.setattr(sglang_plugin.S, "tp_rank", 0)
    monkeypatch.setattr(sglang_plugin.S, "text", SimpleNamespace(model=be._model))
    monkeypatch.setattr(sglang_plugin, "_SEEN_RINGS", set())
    selfcheck_file(tmp_path, "tok", "want").write_text("")
    s = _warmup(be.info.vocab_size)
    n = s.num_tokens
    # a batched pass: another builder's request (no .want), then ours (rows n..2n), then one not ours
    fb = SimpleNamespace(rids=["hsds-other-0", "hsds-tok-0", "user-1"], extend_seq_lens_cpu=[n, n, 3],
                         extend_prefix_lens_cpu=[0, 0, 0])
    token, hooks = sglang_plugin._self_check_hooks(fb)
    assert token == "tok" and hooks.rows == (n, 2 * n)
    assert sglang_plugin._self_check_hooks(fb) is None  # once per ring
    ids = torch.from_numpy(np.concatenate([s.input_ids[::-1].copy(), s.input_ids])).long()
    with torch.inference_mode():  # one sequence of 2n positions: rows n..2n are ours (causal: not the same states)
        be._model(input_ids=ids[None])
    sglang_plugin._save_self_check(token, hooks)
    ref = torch.load(selfcheck_file(tmp_path, "tok", "pt"), weights_only=True)
    assert all(v.shape == (n, 64) for v in ref.values())
    # rows n..2n of the long pass are not the prompt alone (they attend to the first n): the check says so
    (r,) = list(be.capture([s]))
    with pytest.raises(SelfCheckError, match="equals no decoder layer's output"):
        check_capture("SGLang 9.9.9", {1: r.layer(1), 3: r.layer(3), FINAL: r.final}, ref)
    # the same prompt alone in its pass: equal
    fb = SimpleNamespace(rids=["hsds-tok2-0"], extend_seq_lens_cpu=[n], extend_prefix_lens_cpu=[0])
    selfcheck_file(tmp_path, "tok2", "want").write_text("")
    token, hooks = sglang_plugin._self_check_hooks(fb)
    (r,) = list(be.capture([s]))
    sglang_plugin._save_self_check(token, hooks)
    be.close()
    ref = torch.load(selfcheck_file(tmp_path, "tok2", "pt"), weights_only=True)
    assert check_capture("SGLang 9.9.9", {1: r.layer(1), 3: r.layer(3), FINAL: r.final}, ref).startswith("passed")
