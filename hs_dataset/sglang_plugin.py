"""The SGLang plugin's entry point, as SGLang loads it (``sglang.srt.plugins``: ``hs_dataset_capture =
hs_dataset.sglang_plugin:register``). The hooks are in :mod:`hs_dataset.capture.sglang.plugin`."""

from hs_dataset.capture.sglang.plugin import register

__all__ = ["register"]
