"""The capture backends by name: ``transformers`` and ``sglang`` (each imported when asked for)."""

from __future__ import annotations

from hs_dataset.config import did_you_mean
from hs_dataset.errors import ConfigError
from hs_dataset.layout import BACKENDS

__all__ = ["backend_class"]


def backend_class(name: str) -> type:
    """The class of backend ``name``.

    Raises:
        ConfigError: an unknown backend name (naming the closest).
    """
    if name == "transformers":
        from hs_dataset.capture.transformers import TransformersBackend  # deferred: it imports torch

        return TransformersBackend
    if name == "sglang":
        from hs_dataset.capture.sglang.backend import SGLangBackend  # deferred: SGLang is optional

        return SGLangBackend
    raise ConfigError(f"unknown backend {name!r}: use --set backend=transformers or --set backend=sglang"
                      f"{did_you_mean(name, BACKENDS)}")
