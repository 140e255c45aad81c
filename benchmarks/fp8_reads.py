#!/usr/bin/env python3
"""An fp8 build read for training: the host's decode against the stored codes decoded on the trainer's device.

Builds (untimed, from precomputed states: ``benchmarks/storage.py``) an fp8 version at Kimi-K2.5's width (3 aux
layers + final, 7,168 wide, 2,048 tokens a sample) into ``--dir`` (default /dev/shm), then reads it into
``DrafterCollator`` batches of ``--batch`` samples, files in the page cache, three ways, each ``--reps`` times in
turn (the median counts):

  decode        ``iter_torch(ds)``: fp8 decoded to bf16 on the host, collated as bf16
  codes         ``iter_torch(ds, fp8="codes")``: the codes and scales collated as they are stored
  codes+decode  the same, then ``decode_on(batch, --device)``: the batch decoded where the trainer runs
                (``cpu`` here; ``cuda`` on a GPU, where it also moves the batch)

Printed: tokens/s and GB/s of bf16 states delivered (what the trainer gets decoded), and the bytes a batch
holds on the host (what a DataLoader hands over and a trainer moves to its GPU).

    python benchmarks/fp8_reads.py --json benchmarks/results/<date>-<machine>-fp8-reads.json
    python benchmarks/fp8_reads.py --device cuda      (on a GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)


def build_fp8(work: Path, hidden: int, tokens: int, samples: int) -> Path:
    from storage import PrecomputedBackend, Shape, make_model_dir, make_source, make_states

    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.write.driver import build

    shape = Shape(hidden, 3, tokens, samples)
    model = make_model_dir(work / "model", hidden)
    source = make_source(work / "source.jsonl", samples, tokens)
    out = work / "fp8"
    build(HiddenStatesConfig(model=str(model), layers=shape.layers(), source=str(source), max_length=tokens,
                             storage_dtype="fp8_e4m3", part_size=4),
          out, backend=PrecomputedBackend(model, shape.layers(), make_states(shape)), progress=False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="where decode_on decodes (cuda on a GPU)")
    ap.add_argument("--dir", default="/dev/shm", help="where the build is written")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    from hs_dataset.read import DrafterCollator, iter_torch, open_dataset
    from hs_dataset.read.collate import decode_on

    work = Path(tempfile.mkdtemp(prefix="hs-fp8-reads-", dir=a.dir))
    try:
        ds = open_dataset(build_fp8(work, a.hidden, a.tokens, a.samples))
        collator = DrafterCollator()
        held: dict[str, int] = {}

        def read(way: str) -> int:
            """One pass over the build; -> tokens delivered."""
            tokens, buf = 0, []
            rows = iter_torch(ds, fp8="decode" if way == "decode" else "codes")
            for i, row in enumerate(rows):
                buf.append(row)
                if len(buf) == a.batch or i == len(ds) - 1:
                    batch = collator(buf)
                    held[way] = sum(v.nbytes for v in batch.values())
                    if way == "codes+decode":
                        batch = decode_on(batch, a.device)
                        if a.device.startswith("cuda"):
                            torch.cuda.synchronize()
                    tokens += int(batch["attention_mask"].sum())
                    buf = []
            return tokens

        ways = ("decode", "codes", "codes+decode")
        runs: dict[str, list[float]] = {w: [] for w in ways}
        for w in ways:  # warm-up: the collator's buffers, the page cache
            read(w)
        for rep in range(a.reps):
            for w in ways[rep % 3:] + ways[:rep % 3]:
                t = time.perf_counter()
                n = read(w)
                runs[w].append(n / (time.perf_counter() - t))
        per_token = 4 * a.hidden * 2  # bf16 bytes a token of the 4 states, as the trainer gets them
        res = {"setup": {"hidden": a.hidden, "tokens": a.tokens, "samples": a.samples, "batch": a.batch,
                         "reps": a.reps, "device": a.device, "cpus": os.cpu_count(),
                         "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
               "ways": {w: {"tok_s_median": round(statistics.median(r)), "tok_s_runs": [round(x) for x in r],
                            "bf16_GBps_median": round(statistics.median(r) * per_token / 1e9, 2),
                            "batch_host_MB": round(held[w] / 1e6, 1)} for w, r in runs.items()}}
        for w, v in res["ways"].items():
            print(f"{w:14s} {v['tok_s_median']:9,d} tok/s  {v['bf16_GBps_median']:5.2f} GB/s of bf16 states  "
                  f"batch on the host {v['batch_host_MB']:7.1f} MB")
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
