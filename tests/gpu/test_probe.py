"""``verify --probe`` on the device (issue 30): a build at Kimi-K2.5's width made through SGLang (DeepSeek-V3
architecture, hidden 7168, 6 layers: ``.gpu/make_kimi_width.py``; layers 1, 3, 4 + final = 57,344 bytes a
token) passes a probe of 64 of its rows re-run through the transformers backend on the GPU, and the
same probe names both samples of a pair whose states were swapped afterwards (checksums recorded again).
Timings and the worst parity per column go to ``$OUT/gpu_probe.json``. Run on the device:

    source .gpu/device-setup.sh && python3 -m pip install --no-deps --no-build-isolation --no-index -e . \\
        && python -m pytest -m gpu -v -rs tests/gpu/test_probe.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.gpu.models import GPU_MARKS

ROOT = Path(__file__).resolve().parents[2]
MAKER = ROOT / ".gpu" / "make_kimi_width.py"
pytestmark = [
    *GPU_MARKS,
    pytest.mark.skipif(not MAKER.is_file(), reason="needs .gpu/make_kimi_width.py (cp -r ../shared/gpu/* .gpu/)"),
]

ROWS, TOKENS, PROBE = 96, 1024, 64
LAYERS = (1, 3, 4)
PAIR = (10, 11)
ENGINE_ARGS = dict(attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
                   disable_cuda_graph=True, mem_fraction_static=0.5,
                   log_level=os.environ.get("HS_TEST_SGLANG_LOG_LEVEL", "warning"))
REPORT = Path(os.environ.get("OUT", "/tmp")) / "gpu_probe.json"


def kimi_width(path: Path) -> Path:
    """The Kimi-width checkpoint (random weights, made on the GPU) with the tiny DeepSeek-style tokenizer."""
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, str(MAKER), str(path)], check=True)
    if not (path / "tokenizer_config.json").exists():
        from hs_dataset.demo.tiny import make_tiny_tokenizer

        make_tiny_tokenizer(path, template="deepseek")
    return path


def test_a_probe_of_64_rows_passes_a_kimi_width_sglang_build_and_names_a_swapped_pair(tmp_path):
    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.integrity.probe_inputs import pick_rows
    from hs_dataset.integrity.verify import ProbeOptions, verify_build
    from hs_dataset.write.driver import build
    from tests.fixtures import faults as F

    res: dict = {"gpu": torch.cuda.get_device_name(), "rows": ROWS, "tokens_per_row": TOKENS, "probe_rows": PROBE}

    def dump() -> None:
        REPORT.write_text(json.dumps(res, indent=1))

    t = time.time()
    model = kimi_width(Path("/tmp/probe-kimi-width"))
    res["model_make_s"] = round(time.time() - t, 1)
    rng = np.random.default_rng(0)
    src = tmp_path / "source.jsonl"
    src.write_text("".join(json.dumps({"input_ids": rng.integers(3, 1000, size=TOKENS).tolist()}) + "\n"
                           for _ in range(ROWS)))
    cfg = HiddenStatesConfig(model=str(model), layers=LAYERS, source=str(src), max_length=TOKENS, backend="sglang",
                             part_size=16, backend_options={"max_inflight": 32, "ring_bytes": 8 << 30,
                                                            "engine_args": ENGINE_ARGS})
    out = tmp_path / "kimi-width"
    t = time.time()
    s = build(cfg, out, progress=False)
    res["build"] = {"seconds": round(time.time() - t, 1), "written": s.counts.written, "bytes": s.bytes_written}
    dump()
    assert s.counts.written == ROWS
    torch.cuda.empty_cache()

    t = time.time()
    report = verify_build(out, probe=ProbeOptions(rows=PROBE, device="cuda"))
    assert report.probe is not None
    res["probe"] = {"wall_s": round(time.time() - t, 1), "probe_s": round(report.probe.seconds, 1),
                    "forward_s": round(report.probe.reference_seconds, 1), "ok": report.ok,
                    "worst": report.probe.summary(), "tokens_checked": report.probe.tokens_checked,
                    "message": report.message()[-4000:]}
    dump()
    assert report.ok, report.message()

    seed = next(k for k in range(10_000) if set(PAIR) <= set(pick_rows(ROWS, PROBE, k)))
    a, b = (F.read_row(out, r) for r in PAIR)
    F.edit_rows(out, {PAIR[0]: F.states_from(b), PAIR[1]: F.states_from(a)})
    assert verify_build(out, mark=False).ok  # the bytes are the recorded ones: only the probe can tell
    t = time.time()
    bad = verify_build(out, probe=ProbeOptions(rows=PROBE, seed=seed, device="cuda"), mark=False)
    named = {m.group(1) for p in bad.problems if (m := re.search(r"row \d+ \(([^)]+)\)", p.what))}
    res["swapped"] = {"wall_s": round(time.time() - t, 1), "seed": seed, "named": sorted(named),
                      "problems": [str(p) for p in bad.problems]}
    dump()
    assert named == {a["id"], b["id"]}, bad.message()
    assert all("hold the states of sample" in p.what for p in bad.problems), bad.message()
