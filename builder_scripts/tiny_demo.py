"""Tiny demo: a random-weight Llama (4 layers, hidden 64) and a small ChatML tokenizer, made once
locally, run on the CPU over the bundled demo conversations (64 samples; seconds on 2 cores).

    hs-dataset build builder_scripts/tiny_demo.py --output demo_out
"""

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("HS_DATASET_CACHE", Path.home() / ".cache" / "hs_dataset"))
DEMO_MODEL = CACHE / "tiny-demo-llama"

CONFIG = {
    "model": str(DEMO_MODEL),
    "layers": [0, 1, 2],  # outputs of decoder layers 0-2 (of 4) + the final post-norm state
    "max_length": 512,
    "source": str(HERE / "data" / "demo_conversations.jsonl"),
    "backend": "transformers",
    "backend_options": {"device": "cpu", "batch_tokens": 4096},
    "storage_dtype": "bfloat16",
    "part_size": 16,
}


def prepare(config: dict) -> None:
    """Create the demo's tiny model + tokenizer on first use (no download), in its own cache folder only:
    any other ``--set model=`` path is used as it is (a missing one is the usual clear error)."""
    from hs_dataset.demo.tiny import make_tiny_model_dir

    if Path(config["model"]).resolve() == DEMO_MODEL.resolve():
        make_tiny_model_dir(config["model"], template="chatml", seed=0)
