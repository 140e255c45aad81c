"""Starting a capture backend by name: ``transformers`` (the reference, any device) or ``sglang`` (GPU,
fast), optionally isolated in a child process (``backend_options.isolate``)."""

from __future__ import annotations

from typing import Any

from hs_dataset.capture.base import CaptureBackend
from hs_dataset.capture.isolated import ProcessBackend
from hs_dataset.capture.options import ISOLATE_OPTIONS, check_backend_options
from hs_dataset.capture.registry import backend_class
from hs_dataset.model_info import ModelInfo

__all__ = ["make_backend"]


def make_backend(name: str, model: str | ModelInfo, layers: tuple[int, ...], *, revision: str | None = None,
                 options: dict[str, Any] | None = None, trust_remote_code: bool = False) -> CaptureBackend:
    """Start the named backend for a local model directory (or the :class:`ModelInfo` a build resolved).

    Args:
        name: ``transformers`` or ``sglang``.
        model: the model directory, or its :class:`ModelInfo` with ``layers`` checked already.
        layers: the captured layers (:mod:`hs_dataset.model_info`'s convention).
        revision: recorded in the metadata (the directory is used as it is).
        options: the backend's own keyword arguments, except ``isolate: true``, which runs the backend
            in a child process (:class:`~hs_dataset.capture.isolated.ProcessBackend`) so that its death or
            hang stops the build with a clear error; with it, ``timeout`` (seconds without a result
            before the child counts as hung, default 600), ``start_timeout`` (default 3600) and
            ``max_inflight`` (default 64) tune the isolation
            (:func:`hs_dataset.capture.options.backend_options` lists them all).
        trust_remote_code: the build's; becomes the backend's ``trust_remote_code`` unless ``options``
            set it.

    Raises:
        ConfigError: an unknown backend or option (naming the closest).
    """
    options = dict(options or {})
    if trust_remote_code:
        options.setdefault("trust_remote_code", True)
    check_backend_options(name, options)  # an unknown option: one line naming the closest, not a TypeError
    if options.pop("isolate", False):
        iso = {k: options.pop(k) for k in ISOLATE_OPTIONS[1:] if k in options}
        if name == "sglang" and "max_inflight" in iso:
            options["max_inflight"] = iso["max_inflight"]  # also the engine's own in-flight limit
        return ProcessBackend(name, model, layers, revision=revision, options=options, **iso)
    return backend_class(name)(model, layers, revision=revision, **options)
