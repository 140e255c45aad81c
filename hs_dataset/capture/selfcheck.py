"""The start-up self-check of the capture convention: what a backend records as ``layer k`` must be decoder
layer k's output, and ``hidden_final`` the final norm's output, exactly (bf16).

One short warm-up prompt is captured through the backend's normal path while :class:`ReferenceHooks` (PyTorch
forward hooks on every decoder layer and on the final norm, independent of the engine's own capture positions)
keep what those modules returned for the same rows of the same forward pass. :func:`check_capture` compares the
two and names the layer that was really captured when they differ. The SGLang plugin runs the hooks in the
scheduler (TP rank 0) for the builder's first request; the builder compares what its ring received with them, so
the check covers the whole path, the copies out of SGLang's buffers included. The transformers backend's model
runs the same hooks in the CPU tests.

Imports nothing but torch: the SGLang plugin loads it in SGLang's scheduler processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["FINAL", "SELF_CHECK_TOKENS", "ReferenceHooks", "SelfCheckError", "check_capture", "layer_output",
           "residual_sum", "selfcheck_file", "warmup_ids"]

FINAL = "final"
SELF_CHECK_TOKENS = 24  # one short prompt: a single prefill pass, every position a row


class SelfCheckError(RuntimeError):
    """The captured states are not the states hs_dataset records under their names."""


def selfcheck_file(directory: str | os.PathLike, token: str, suffix: str) -> Path:
    """The self-check's files in the ring's folder: ``.want`` (the builder asks for it, before its first request),
    ``.pt`` (the plugin's reference states)."""
    return Path(directory, f"selfcheck-{token}.{suffix}")


def warmup_ids(vocab_size: int, n: int = SELF_CHECK_TOKENS) -> list[int]:
    """``n`` fixed token ids spread over the vocabulary (no special token: ids from 5 up)."""
    span = max(1, int(vocab_size) - 10)
    return [5 + (i * 7919 + 13) % span for i in range(n)]


def layer_output(output: Any) -> torch.Tensor:
    """A decoder layer's output as a forward hook sees it: the tensor, or the first of a tuple (HF layers)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def residual_sum(output: Any) -> torch.Tensor:
    """A layer that returns ``(hidden, residual, ...)`` with the residual add deferred to the next fused
    add-RMSNorm (SGLang up to 0.5.20-0.5.21): the layer's output is their sum (the state SGLang's aux capture
    appends at the next layer's entry)."""
    if isinstance(output, (tuple, list)) and len(output) > 1 and isinstance(output[1], torch.Tensor):
        return output[0] + output[1]
    return layer_output(output)


class ReferenceHooks:
    """Forward hooks on every decoder layer and on the final norm, keeping copies of their outputs for rows
    ``rows`` of the pass (all rows: None) under ``layer_<k>`` and ``final``.

    Args:
        layers: the decoder layers, in order. norm: the final norm (None: no ``final``).
        read: a layer's output as hs_dataset records it, from what its forward returned (:func:`layer_output`;
            SGLang's plugin passes its own, :func:`residual_sum` and the residual stream of 0.5.21+).
        rows: ``(start, stop)`` of the rows to keep (a batched pass holds other requests too).
    """

    def __init__(self, layers: Sequence[torch.nn.Module], norm: torch.nn.Module | None, *,
                 read: Callable[[Any], torch.Tensor] = layer_output, rows: tuple[int, int] | None = None):
        self.states: dict[str, torch.Tensor] = {}
        self.rows = rows
        self._read = read
        self._handles = [m.register_forward_hook(self._keep(f"layer_{k}")) for k, m in enumerate(layers)]
        if norm is not None:
            self._handles.append(norm.register_forward_hook(self._keep(FINAL)))

    def _keep(self, name: str):
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            t = self._read(output) if name != FINAL else layer_output(output)  # a fused norm: (normed, residual)
            t = t.reshape(-1, t.shape[-1])  # HF: [batch, T, H] -> rows; SGLang: already [tokens, H]
            if self.rows is not None:
                t = t[self.rows[0]:self.rows[1]]
            self.states[name] = t.detach().clone()  # a copy now: the engine may reuse the buffer later in the pass
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def cpu(self) -> dict[str, torch.Tensor]:
        """The kept states, on the CPU."""
        return {k: v.cpu() for k, v in self.states.items()}


def _name(key: str, last: int) -> str:
    if key == FINAL:
        return "hidden_final (the final norm's output)"
    k = int(key.split("_")[1])
    return f"layer {k}" + (" (before the final norm)" if k == last else "")


def check_capture(engine: str, captured: Mapping[int | str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                  ) -> str:
    """Compare the states a backend recorded (``{layer k: [T, H], "final": [T, H]}``) with
    :class:`ReferenceHooks`' ``reference``; return a one-line summary when every one is exactly equal.

    Args:
        engine: what captured them, for the message (``"SGLang 0.5.17"``).

    Raises:
        SelfCheckError: one line naming the first state that differs and, when one of the reference states equals
            it, what was really captured ("SGLang X captured the output of layer 4 where hs_dataset records
            layer 3: ...").
    """
    layer_keys = sorted((k for k in reference if k != FINAL), key=lambda k: int(k.split("_")[1]))
    last = len(layer_keys) - 1
    checked = []
    for key, got in captured.items():
        want_key = FINAL if key == FINAL else f"layer_{int(key)}"
        if want_key not in reference:
            raise SelfCheckError(f"{engine}: the self-check's forward hooks saw no {_name(want_key, last)} (they did "
                                 "not run: a CUDA-graph or compiled pass?), so the capture convention is unchecked")
        want = reference[want_key]
        got = got.reshape(-1, got.shape[-1]).to(want.dtype)
        if got.shape == want.shape and torch.equal(got, want):
            checked.append(want_key)
            continue
        same = [k for k in layer_keys + [FINAL] if reference[k].shape == got.shape and torch.equal(reference[k], got)]
        if same:
            raise SelfCheckError(f"{engine} captured the output of {_name(same[0], last)} where hs_dataset records "
                                 f"{_name(want_key, last)}: the capture convention of this release differs from the "
                                 "audited one; use an audited release (docs/sglang-releases.md) and report it")
        if got.shape != want.shape:
            detail = f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        else:
            d = (got.float() - want.float()).abs()
            nearest = min(layer_keys + [FINAL], key=lambda k: float((reference[k].float() - got.float()).abs().mean())
                          if reference[k].shape == got.shape else float("inf"))
            detail = (f"{int((d > 0).sum())} of {d.numel()} values differ, max by {float(d.max()):.3g}; nearest: "
                      f"{_name(nearest, last)}")
        raise SelfCheckError(f"{engine} recorded as {_name(want_key, last)} a state that equals no decoder layer's "
                             f"output ({detail}): the capture convention of this release differs from the audited "
                             "one; use an audited release (docs/sglang-releases.md) and report it")
    n = next(iter(reference.values())).shape[0] if reference else 0
    names = ", ".join(k.replace("_", " ") for k in checked)
    return f"passed: {names} equal the decoder layers' and final norm's outputs exactly ({n}-token warm-up prompt)"
