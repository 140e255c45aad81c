"""Builder script of tests/test_regenerate.py's kill test (the same build as its fixture)."""

from pathlib import Path

CONFIG = {
    "model": "",  # --set model=...
    "layers": [0, 1, 2],
    "source": str(Path(__file__).resolve().parent.parent / "builder_scripts" / "data" / "demo_conversations.jsonl"),
    "max_length": 256,
    "part_size": 4,
    "max_samples": 8,
    "responses": "regenerate",
    "generation": {"max_new_tokens": 12, "on_length": "keep"},
    "backend_options": {"device": "cpu", "batch_tokens": 2048},
}
