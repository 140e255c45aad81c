"""The Kimi-width stand-in's engine settings, layers and synthetic source, shared by long_context.py and
compact.py (``../shared/gpu/make_kimi_width.py --long-context`` makes the model)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ENGINE_ARGS = dict(attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
                   disable_cuda_graph=True, mem_fraction_static=0.6, context_length=131080)
LAYERS = (1, 3, 4)


def source(path: Path, samples: int, tokens: int, seed: int) -> Path:
    """``samples`` conversations each longer than ``tokens`` for the tiny tokenizer (cut to max_length)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(samples):
            words = " ".join(map(str, rng.integers(0, 10**6, size=int(tokens * 0.45) + 64)))
            f.write(json.dumps({"messages": [{"role": "user", "content": "Read this."},
                                             {"role": "assistant", "content": words}]}) + "\n")
    return path
