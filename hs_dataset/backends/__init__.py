"""Capture backends: ``transformers`` (reference, any machine) and ``sglang`` (GPU, fast)."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
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


ISOLATE_OPTIONS = ("isolate", "timeout", "start_timeout", "max_inflight")


def make_backend(name: str, model: str, layers: tuple[int, ...], *, revision: str | None = None,
                 options: dict[str, Any] | None = None, trust_remote_code: bool = False) -> CaptureBackend:
    """Start the named backend for a local model directory.

    ``options`` are the backend's own keyword arguments, except ``isolate: true``, which runs the
    backend in a child process (:class:`~hs_dataset.backends.process.ProcessBackend`) so that its
    death or hang stops the build with a clear error; with it, ``timeout`` (seconds without a
    result before the child counts as hung, default 600), ``start_timeout`` (default 3600) and
    ``max_inflight`` (default 64) tune the isolation. ``trust_remote_code`` (the build's
    ``trust_remote_code``) becomes the backend's ``trust_remote_code`` option unless ``options`` set it.
    :func:`hs_dataset.backends.options.backend_options` lists the options.

    Raises:
        ConfigError: an unknown backend or option (naming the closest).
    """
    from .options import check_backend_options

    options = dict(options or {})
    if trust_remote_code:
        options.setdefault("trust_remote_code", True)
    check_backend_options(name, options)  # an unknown option: one line naming the closest, not a TypeError
    if options.pop("isolate", False):
        from .process import ProcessBackend

        iso = {k: options.pop(k) for k in ISOLATE_OPTIONS[1:] if k in options}
        if name == "sglang" and "max_inflight" in iso:
            options["max_inflight"] = iso["max_inflight"]  # also the engine's own in-flight limit
        return ProcessBackend(name, model, layers, revision=revision, options=options, **iso)
    if name == "transformers":
        from .transformers import TransformersBackend

        return TransformersBackend(model, layers, revision=revision, **options)
    if name == "sglang":
        from .sglang import SGLangBackend

        return SGLangBackend(model, layers, revision=revision, **options)
    raise ConfigError(f"unknown backend {name!r}: use --set backend=transformers or --set backend=sglang")
