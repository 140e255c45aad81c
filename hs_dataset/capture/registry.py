"""The capture backends by name: ``transformers`` and ``sglang`` (each imported when asked for)."""

from __future__ import annotations

import importlib

from hs_dataset.config import did_you_mean
from hs_dataset.errors import ConfigError
from hs_dataset.layout import BACKENDS

__all__ = ["BACKEND_CLASSES", "backend_class", "class_path"]

# Each backend's class, as (module, class name): imported only to start it (both import torch; SGLang is
# optional). Their options are declared in hs_dataset.capture.options.
BACKEND_CLASSES = {
    "transformers": ("hs_dataset.capture.transformers", "TransformersBackend"),
    "sglang": ("hs_dataset.capture.sglang.backend", "SGLangBackend"),
}


def class_path(name: str) -> tuple[str, str]:
    """``(module, class name)`` of backend ``name``.

    Raises:
        ConfigError: an unknown backend name (naming the closest).
    """
    if name not in BACKEND_CLASSES:
        raise ConfigError(f"unknown backend {name!r}: use --set backend=transformers or --set backend=sglang"
                          f"{did_you_mean(name, BACKENDS)}")
    return BACKEND_CLASSES[name]


def backend_class(name: str) -> type:
    """The class of backend ``name`` (its module imported now: torch, and SGLang for ``sglang``).

    Raises:
        ConfigError: an unknown backend name (naming the closest).
    """
    module, cls = class_path(name)
    return getattr(importlib.import_module(module), cls)
