"""Is ``--model`` the model that made the files? Checked before an import writes anything.

The import's other checks are shapes (hidden size, layer count, token ids inside the vocabulary),
and a wrong model of the same shapes passes them all: a DeepSeek-V3 directory of Llama's hidden
size, depth and vocabulary takes Llama's files with no reject. So, before the build,
:data:`CHECK_SAMPLES` usable samples spread over the folder are recomputed with the transformers backend on the CPU, on
their first :data:`CHECK_TOKENS` tokens (a causal model's states of a prefix depend on the prefix
alone), and every imported state (each layer, then ``hidden_final``) must match what the model
computes: a mean token cosine of at least :data:`MIN_COSINE` and a relative mean absolute error of
at most :data:`MAX_REL_ERROR` (the measures of the GPU parity tests, ``tests/gpu/test_sglang.py``,
which ask 0.999 and 2% of two bf16 engines; here looser, as the files may be another engine's on
another device over many more layers, or FP8, whose e4m3 rounds a value by up to 2^-4 of its token's
largest). The model that made the files gives a cosine near 1, another model one near 0, and the
neighbouring layer of the same model (a wrong ``--layers``) one clearly lower (0.67 on the tiny
test model).

``check=False`` (``--skip-model-check``) is for models too large to run on the CPU: then only the
cheap check runs where it applies: files carrying both ``hidden_final`` and layer ``L-1`` (before
the norm) must agree with the model's final norm (:mod:`hs_dataset.interop.final_norm`).
The outcome is one line, in ``hs_dataset.json`` (``backend.options.model_check``) and printed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from hs_dataset.errors import InteropError
from hs_dataset.interop.final_norm import FinalNorm, load_final_norm
from hs_dataset.model_info import ModelInfo
from hs_dataset.records import CaptureResult, TokenizedSample

__all__ = ["CHECK_SAMPLES", "CHECK_TOKENS", "MAX_REL_ERROR", "MIN_COSINE", "check_model", "compare_states"]

CHECK_SAMPLES = 3  # spread over the folder (the first, the middle, the last usable file)
CHECK_TOKENS = 256
MIN_COSINE = 0.99
MAX_REL_ERROR = 0.10
_WEIGHTS = (".safetensors", ".bin")


def compare_states(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(mean token cosine, relative mean absolute error)`` of ``got`` against ``ref`` (``[T, H]``)."""
    g, r = got.float(), ref.float()
    cos = torch.nn.functional.cosine_similarity(g, r, dim=-1).mean().item()
    return cos, ((g - r).abs().mean() / r.abs().mean().clamp(min=1e-30)).item()


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _names(layers: tuple[int, ...]) -> list[str]:
    return [f"hidden_layer_{k}" for k in layers] + ["hidden_final"]


def _recompute(picked: list[CaptureResult], info: ModelInfo, layers: tuple[int, ...], model: str,
               trust_remote_code: bool) -> str:
    from hs_dataset.capture.transformers import TransformersBackend  # deferred: transformers is a slow import

    weights = sum(p.stat().st_size for p in Path(model).iterdir() if p.name.endswith(_WEIGHTS))
    skip = "pass --skip-model-check to import without this check (the files' states are then trusted)"
    if weights == 0:
        raise InteropError(f"checking --model against the files runs it on the CPU, and {model} has no weights "
                           f"(*.safetensors): pass the model's full directory, or {skip}")
    free = _available_bytes()
    if free is not None and weights > 0.8 * free:
        raise InteropError(f"checking --model against the files runs it on the CPU: its weights "
                           f"({weights / 2**30:.1f} GiB) do not fit the {free / 2**30:.1f} GiB of memory available; "
                           f"{skip}")
    cut = [TokenizedSample(r.sample.sample_id, r.sample.input_ids[:CHECK_TOKENS], r.sample.loss_mask[:CHECK_TOKENS])
           for r in picked]
    try:
        ref = TransformersBackend(info, layers, device="cpu", batch_tokens=CHECK_TOKENS,
                                  trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises nearly anything for a model it cannot run here
        raise InteropError(f"checking --model against the files runs it on the CPU, and {model} does not load "
                           f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); {skip}") from e
    try:
        computed = [r for r in ref.capture(cut) if isinstance(r, CaptureResult)]
    finally:
        ref.close()
    worst_cos, worst_err = 1.0, 0.0
    for f, c in zip(picked, computed):
        T = c.states.shape[1]
        for name, a, b in zip(_names(layers), f.states[:, :T], c.states):
            cos, err = compare_states(a, b)
            if cos < MIN_COSINE or err > MAX_REL_ERROR:
                raise InteropError(
                    f"sample {f.sample.sample_id}: {name} is not what {model} computes (mean cosine {cos:.3f}, "
                    f"relative error {err:.2f}; a match: >= {MIN_COSINE}, <= {MAX_REL_ERROR}): pass the --model and "
                    "--layers the files were made with (--skip-model-check: for a model too large to run on the CPU)")
            worst_cos, worst_err = min(worst_cos, cos), max(worst_err, err)
    return (f"model check: {len(picked)} samples (first {CHECK_TOKENS} tokens) recomputed with {model} on the CPU "
            f"(transformers): every state matches (worst mean cosine {worst_cos:.4f}, relative error {worst_err:.4f})")


def _norm_check(picked: list[CaptureResult], info: ModelInfo, layers: tuple[int, ...], model: str,
                norm: FinalNorm | None) -> str:
    last = info.num_layers - 1
    skipped = "model check skipped (--skip-model-check): the files' states are taken to be " + model + "'s"
    if norm is not None or last not in layers:  # a computed hidden_final: nothing to compare it with
        return skipped
    try:
        final_norm = load_final_norm(model, "the final-norm check")
    except InteropError:
        return skipped + " (no final-norm check: the model's final norm cannot be read)"
    j = layers.index(last)
    for f in picked:
        cos, err = compare_states(f.states[-1], final_norm(f.states[j]))
        if cos < MIN_COSINE or err > MAX_REL_ERROR:
            raise InteropError(f"sample {f.sample.sample_id}: hidden_final is not {model}'s final norm of "
                               f"hidden_layer_{last} (mean cosine {cos:.3f}, relative error {err:.2f}): pass the "
                               "--model the files were made with")
    return skipped + f"; hidden_final matches its final norm of hidden_layer_{last} in {len(picked)} samples"


def check_model(samples: Iterable[CaptureResult], info: ModelInfo, layers: tuple[int, ...], model: str, *,
                check: bool = True, norm: FinalNorm | None = None, trust_remote_code: bool = False) -> str:
    """Check that ``model`` made the files; return what was checked, in one line.

    Args:
        samples: the files' states of the usable samples, in order (``[len(layers) + 1, T, H]`` each,
            ``hidden_final`` last, as the import stores them; each ``sample_id`` the file's); the first
            :data:`CHECK_SAMPLES` with finite states are used, the rest are not read (the import passes files
            spread over its folder; :mod:`hs_dataset.interop.file_check` compares every file with them).
        info, layers: the model's sizes and the files' layers (hs_dataset convention).
        model: the ``--model`` directory.
        check: recompute the samples (False: ``--skip-model-check``, only the cheap check).
        norm: the final norm the import computes ``hidden_final`` with (None: the files carry it).
        trust_remote_code: as for the import.

    Raises:
        InteropError: a state differs from the model's (naming the sample and the state), or the model
            cannot run on the CPU (no weights, more than the memory available: ``--skip-model-check``).
    """
    picked = []
    for got in samples:
        if bool(torch.isfinite(got.states).all()):  # NaN/Inf is that sample's reject, not a verdict on the model
            picked.append(got)
            if len(picked) == CHECK_SAMPLES:
                break
    if not picked:
        return "model check: no sample could be read to check --model with"
    if not check:
        return _norm_check(picked, info, layers, model, norm)
    return _recompute(picked, info, layers, model, trust_remote_code)
