"""Capture backends: ``transformers`` (reference, any machine) and ``sglang`` (GPU, fast)."""

from __future__ import annotations

from typing import Any

from .base import LAYER_CONVENTION, BackendError, CaptureBackend, ModelInfo, check_layers, read_model_info

__all__ = [
    "LAYER_CONVENTION",
    "BackendError",
    "CaptureBackend",
    "ModelInfo",
    "check_layers",
    "make_backend",
    "read_model_info",
]


def make_backend(name: str, model: str, layers: tuple[int, ...], *, revision: str | None = None,
                 options: dict[str, Any] | None = None) -> CaptureBackend:
    """Start the named backend for a local model directory."""
    options = dict(options or {})
    if name == "transformers":
        from .hf import TransformersBackend

        return TransformersBackend(model, layers, revision=revision, **options)
    if name == "sglang":
        from .sglang import SGLangBackend

        return SGLangBackend(model, layers, revision=revision, **options)
    raise ValueError(f"unknown backend {name!r}: use 'transformers' or 'sglang'")
