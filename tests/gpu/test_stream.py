"""Train while it builds, on the device: an SGLang build with ``--stream`` and a trainer process reading it
on the same node get the rows of the finished build, bit for bit (epoch 0 from the stream, epoch 1 from
the version). The speed figure is ``benchmarks/stream.py --backend sglang``'s.

    python -m pytest -m gpu -v tests/gpu/test_stream.py     # writes $OUT/gpu_stream.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.fixtures.builds import root_env
from tests.gpu.models import GPU_MARKS

pytestmark = GPU_MARKS

ROOT = Path(__file__).resolve().parents[2]
REPORT = Path(os.environ.get("OUT", "/tmp")) / "gpu_stream.json"
ENGINE_ARGS = dict(attention_backend="triton", sampling_backend="pytorch", grammar_backend="none",
                   disable_cuda_graph=True, mem_fraction_static=0.3)


def test_a_trainer_reads_an_sglang_build_as_it_runs(models, tmp_path):
    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.demo.tiny import make_tiny_tokenizer
    from hs_dataset.read.iterate import iter_torch
    from hs_dataset.read.open import open_dataset
    from hs_dataset.stream import StreamPublisher
    from hs_dataset.write.driver import build
    from tests.stream.trainer import digest

    make_tiny_tokenizer(models["llama"], template="chatml")
    src = ROOT / "builder_scripts" / "data" / "demo_conversations.jsonl"
    out = tmp_path / "out"
    cfg = HiddenStatesConfig(model=models["llama"], layers=(1, 3, 7), source=str(src), max_length=512,
                             backend="sglang", part_size=16,
                             backend_options={"max_inflight": 32, "ring_bytes": 256 << 20, "engine_args": ENGINE_ARGS})
    ckpt = tmp_path / "ckpt.json"
    p = subprocess.Popen([sys.executable, "-m", "tests.stream.trainer", str(out), "--ckpt", str(ckpt), "--epochs", "2",
                          "--write", "--prefetch", str(256 << 20)], cwd=ROOT, env=root_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pub = StreamPublisher(budget_bytes=1 << 30)
    t = time.time()
    s = build(cfg, out, progress=False, sink=pub)
    seconds = time.time() - t
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr[-3000:]
    got = json.loads(stdout.splitlines()[-1])
    rows = [[r["id"], digest(r)] for r in iter_torch(open_dataset(out))]
    REPORT.write_text(json.dumps({"written": s.counts.written, "build_s": round(seconds, 1), "publisher": vars(pub.stats),
                                  "trainer": got["stats"]}, indent=1))
    assert len(rows) == s.counts.written > 0
    assert got["epochs"][0] == rows  # the committed bytes, in the version's order
    assert sorted(map(tuple, got["epochs"][1])) == sorted(map(tuple, rows))
    assert got["stats"]["spool"] >= 1
