"""A text-only processor packaged the way Kimi-K2.5's is (hs_dataset's own code, for its tests).

SGLang's Kimi-K2.5 multimodal processor (``sglang/srt/multimodal/processors/kimi_k25.py``) is built
around the checkpoint's own processor, loaded with ``AutoProcessor`` and ``trust_remote_code``: it
reads ``processor.tokenizer``, ``processor.image_processor`` and
``processor.media_processor.media_proc_cfg`` (patch size, merge kernel, patch limits, mean/std).
This module provides those, with the vision geometry of ``preprocessor_config.json``. Images are
not processed: hs_dataset captures text only.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import BatchFeature, ProcessorMixin
from transformers.image_processing_utils import BaseImageProcessor


class KimiK25VisionProcessor(BaseImageProcessor):
    """Holds ``media_proc_cfg``; counts an image's placeholder tokens; processes no pixels."""

    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg: dict | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.media_proc_cfg = dict(media_proc_cfg or {})

    def media_tokens_calculator(self, media: dict) -> int:
        """Placeholder tokens of one ``{"type": "image", "image": PIL image}``: patches after the
        NaViT resize within the patch limits, merged by the merge kernel."""
        cfg = self.media_proc_cfg
        width, height = media["image"].size
        patch, merge = cfg["patch_size"], cfg["merge_kernel_size"]
        scale = min(1.0, math.sqrt(cfg["in_patch_limit"] / max(1.0, (width // patch) * (height // patch))),
                    cfg["patch_limit_on_one_side"] * patch / width, cfg["patch_limit_on_one_side"] * patch / height)
        factor = merge * patch
        new_w, new_h = max(1, int(width * scale)), max(1, int(height * scale))
        return math.ceil(new_w / factor) * math.ceil(new_h / factor)

    def preprocess(self, images: Any, **kwargs: Any) -> BatchFeature:
        raise NotImplementedError("this tiny Kimi-K2.5 processor is text-only: image inputs are not supported")


class KimiK25Processor(ProcessorMixin):
    """Tokenizer + vision processor; ``media_processor`` is the vision processor (SGLang reads it)."""

    def __init__(self, image_processor: KimiK25VisionProcessor | None = None, tokenizer: Any = None,
                 chat_template: str | None = None, **kwargs: Any):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.media_processor = image_processor

    def __call__(self, text: Any = None, medias: list | None = None, **kwargs: Any) -> Any:
        if medias:
            raise NotImplementedError("this tiny Kimi-K2.5 processor is text-only: image inputs are not supported")
        return self.tokenizer(text, **kwargs)
