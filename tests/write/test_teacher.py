"""The teacher's top-k (issue 26, item 1): stored at every loss-masked position, equal to the reference's
log_softmax(lm_head(final)); hidden_final may be left out; the collator's distillation target from the
teacher equals the one computed from hidden_final; exporters that need hidden_final refuse without it."""

from __future__ import annotations

import pytest
import torch

from hs_dataset.codec.teacher import teacher_topk
from hs_dataset.errors import ConfigError, InteropError
from hs_dataset.integrity.verify import verify_build
from hs_dataset.interop import export_dataset
from hs_dataset.read.collate import DrafterCollator
from hs_dataset.read.iterate import iter_torch
from hs_dataset.read.teacher import draft_target
from hs_dataset.write.driver import build
from tests.fixtures.builds import config, load_built

K = 16


@pytest.fixture(scope="module")
def lm(tiny_model):
    from hs_dataset.capture.transformers import load_language_model

    return load_language_model(tiny_model).eval()


@pytest.fixture(scope="module")
def teacher_build(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("teacher") / "out"
    build(config(tiny_model, teacher=f"topk:{K}", max_samples=8), out, progress=False)
    return out


def test_the_teacher_is_the_references_top_k_at_every_masked_position(lm, teacher_build):
    """Against log_softmax(lm_head(final)) of the stored final state: equal within fp32 rounding (1e-5); against
    the whole model's own logits (an unbatched HF forward): within bf16's rounding of the logits (the build batches
    samples, which rounds the final state differently: 2 bf16 steps, 2^-7 of the largest logit)."""
    rows = list(iter_torch(load_built(teacher_build)))
    w = lm.get_output_embeddings().weight.detach()
    assert rows
    for row in rows:
        masked = row["loss_mask"].bool()
        assert row["teacher_ids"].shape == (int(masked.sum()), K) and row["teacher_lse"].shape == (int(masked.sum()),)
        logits = torch.nn.functional.linear(row["hidden_final"][masked], w).float()
        lp, ids = torch.log_softmax(logits, -1).topk(K, -1)
        assert torch.allclose(row["teacher_logprobs"], lp, atol=1e-5), row["id"]
        assert torch.allclose(row["teacher_lse"], torch.logsumexp(logits, -1), atol=1e-5)
        gaps = (lp[:, :-1] - lp[:, 1:]).abs() > 1e-5  # ids equal where the log-probs are not tied
        assert bool((row["teacher_ids"][:, :-1] == ids[:, :-1])[gaps].all())
        with torch.inference_mode():
            whole = lm(input_ids=row["input_ids"].long()[None]).logits[0].float()[masked]
        tol = 2 ** -7 * whole.abs().amax(-1, keepdim=True) + 1e-4
        ref = torch.log_softmax(whole, -1).gather(-1, row["teacher_ids"].long())
        assert bool(((row["teacher_logprobs"] - ref).abs() <= tol).all()), row["id"]


def test_without_hidden_final_the_collator_gives_the_teacher_and_the_target_matches_the_final_state(
        tiny_model, lm, teacher_build, tmp_path):
    out = tmp_path / "nofinal"
    build(config(tiny_model, teacher=f"topk:{K}", store_final=False, max_samples=8), out, progress=False)
    ds = load_built(out)
    assert "hidden_final" not in ds.column_names and "teacher_logprobs" in ds.column_names
    assert verify_build(out).ok and verify_build(teacher_build).ok
    slim = list(iter_torch(ds))
    full = list(iter_torch(load_built(teacher_build)))
    batch = DrafterCollator()(slim[:4])
    assert "hidden_states" not in batch and batch["teacher_ids"].shape[:2] == batch["input_ids"].shape
    assert bool(((batch["teacher_ids"][..., 0] >= 0) == batch["loss_mask"].bool()).all())
    # The target over a draft vocabulary (every third token of the target's), from the stored teacher, equals the
    # one from hidden_final of the build that kept it: the same top-k of lm_head(final), then draft_target.
    vocab = lm.get_output_embeddings().weight.shape[0]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[::3] = True
    target, mask, covered = draft_target(batch["teacher_ids"], batch["teacher_logprobs"], t2d)
    ref_batch = DrafterCollator()(full[:4])
    w = lm.get_output_embeddings().weight.detach()
    for b, row in enumerate(full[:4]):
        m = row["loss_mask"].bool()
        ids, lp, _ = teacher_topk(row["hidden_final"][m], w, K)
        ref_ids = torch.full((row["loss_mask"].shape[0], K), -1, dtype=torch.long)
        ref_lp = torch.full((row["loss_mask"].shape[0], K), float("-inf"))
        ref_ids[m], ref_lp[m] = ids.long(), lp
        want, want_mask, _ = draft_target(ref_ids, ref_lp, t2d)
        n = row["loss_mask"].shape[0]
        assert torch.allclose(target[b, :n], want, atol=1e-5) and torch.equal(mask[b, :n], want_mask)
        assert torch.allclose(target[b, :n].sum(-1)[m], torch.ones(int(m.sum())), atol=1e-5)
    assert bool((covered[batch["loss_mask"].bool()] <= 1 + 1e-6).all())
    assert torch.equal(ref_batch["teacher_ids"], batch["teacher_ids"])
    with pytest.raises(InteropError, match="store_final"):
        export_dataset(out, "specforge", tmp_path / "sf")


def test_teacher_options_are_checked(tiny_model):
    with pytest.raises(ConfigError, match="topk:K"):
        config(tiny_model, teacher="top5")
    with pytest.raises(ConfigError, match="store_final"):
        config(tiny_model, store_final=False)
