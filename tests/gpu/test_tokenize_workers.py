"""The tokenize workers feeding SGLang (issue 28): the Kimi preset (tiktoken tokenizer, trust_remote_code)
built with ``tokenize_workers=2`` writes the rows of ``tokenize_workers=0`` (the same ids and masks, the
states within the parity tolerance of tests/gpu/test_sglang.py), and the capture does not wait longer
for them. Run on the device (README, "GPU tests"):

    python -m pytest -m gpu -q tests/gpu/test_tokenize_workers.py

Writes ``$OUT/gpu_tokenize_workers.json``: each build's seconds and tokens per second.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from tests.fixtures.builds import THINKING_ROWS
from tests.gpu.models import GPU_MARKS
from tests.gpu.test_sglang import ENGINE_ARGS, RING, compare

pytestmark = GPU_MARKS
REPORT = Path(os.environ.get("OUT", "/tmp")) / "gpu_tokenize_workers.json"


def test_kimi_preset_with_tokenize_workers_writes_the_serial_rows(models, tmp_path):
    from hs_dataset.cli import load_preset
    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.read.iterate import iter_torch
    from hs_dataset.read.open import open_dataset
    from hs_dataset.write.driver import build

    rows = [r for i, r in enumerate(THINKING_ROWS) if i != 3] * 60  # 240 conversations, no image row
    src = tmp_path / "thinking.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    preset = Path(__file__).resolve().parents[2] / "builder_scripts" / "kimi_eagle3_hs.py"
    report = {}
    for workers in (0, 2):
        sets = [f"model={models['kimi']}", f"source={src}", "layers=[0,2,3]", "max_length=512", "part_size=32",
                f"tokenize_workers={workers}",
                "backend_options=" + json.dumps({"tp_size": 1, "max_inflight": 32, "ring_bytes": RING,
                                                 "engine_args": ENGINE_ARGS})]
        t = time.time()
        s = build(HiddenStatesConfig(**load_preset(str(preset), sets)), tmp_path / f"w{workers}", progress=False)
        seconds = time.time() - t
        report[f"tokenize_workers={workers}"] = {"seconds": round(seconds, 2), "tokens": s.counts.tokens_written,
                                                 "tok_per_s": round(s.counts.tokens_written / seconds)}
        REPORT.write_text(json.dumps(report, indent=1))
        assert s.counts.written == len(rows) and s.counts.rejected == 0
    for x, y in zip(iter_torch(open_dataset(tmp_path / "w2")), iter_torch(open_dataset(tmp_path / "w0")), strict=True):
        assert x["id"] == y["id"] and torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["loss_mask"], y["loss_mask"])
        for c in ("hidden_layer_0", "hidden_layer_2", "hidden_layer_3", "hidden_final"):
            st = compare(x[c], y[c])
            assert st["mean_cos"] >= 0.999 and st["rel_err"] <= 0.02, (x["id"], c, st)
