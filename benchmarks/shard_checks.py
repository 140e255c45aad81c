"""What the readers' shard check costs (hs_dataset.read.shard_checks): one epoch of open_dataset +
iter_torch + DrafterCollator over Kimi-shaped rows, with the check on (no earlier verdict: every shard
hashed) and off (HS_DATASET_CHECK_SHARDS=0), each run in a fresh process, runs interleaved.

    python benchmarks/shard_checks.py --gb 2 --reps 3            # page cache dropped before each run
    python benchmarks/shard_checks.py --gb 2 --reps 3 --hot      # the shards in the page cache

Prints the best and median throughput of each and the ratio checked / unchecked: the geometric mean over
the pairs of runs (an even number, each order as often: this VM's disk drifts from one minute to the next).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from storage import PrecomputedBackend, Shape, data_files, drop_cache, make_model_dir, make_source, make_states  # noqa: E402


def build_input(work: Path, shape: Shape, shard_mb: int) -> Path:
    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.write.driver import build

    model = make_model_dir(work / "model", shape.hidden)
    source = make_source(work / "src.jsonl", shape.samples, shape.tokens)
    layers = shape.layers()
    cfg = HiddenStatesConfig(model=str(model), source=str(source), layers=layers, max_length=shape.tokens,
                             part_size=max(1, shape.samples // 4), max_shard_bytes=shard_mb << 20,
                             backend_options={"device": "cpu"})
    out = work / "build"
    build(cfg, out, backend=PrecomputedBackend(model, layers, make_states(shape)), progress=False)
    return out


def read_epoch(out: str, batch: int) -> None:
    """The child: one epoch, prints bytes and seconds as JSON."""
    from hs_dataset.read import DrafterCollator, iter_torch, open_dataset

    t0 = time.perf_counter()
    collate, rows, nbytes = DrafterCollator(), [], 0
    for row in iter_torch(open_dataset(out)):
        rows.append(row)
        if len(rows) == batch:
            b = collate(rows)
            nbytes += b["hidden_states"].numel() * 2 + b["aux_hidden_states"].numel() * 2
            rows = []
    print(json.dumps({"bytes": nbytes, "seconds": time.perf_counter() - t0}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=6, help="pairs of runs (rounded up to an even number)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--shard-mb", type=int, default=512)
    ap.add_argument("--hot", action="store_true", help="leave the shards in the page cache")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        read_epoch(a.child, a.batch)
        return 0
    shape = Shape(a.hidden, 3, a.tokens, 0)
    shape.samples = max(2, int(a.gb * 2**30 // shape.sample_bytes))
    with tempfile.TemporaryDirectory(prefix="hs-checks-bench-", dir=os.environ.get("TMPDIR", "/var/tmp")) as d:
        work = Path(d)
        out = build_input(work, shape, a.shard_mb)
        runs: dict[str, list[float]] = {"checked": [], "unchecked": []}
        reps = a.reps + a.reps % 2
        for rep in range(reps):
            for mode in ("checked", "unchecked") if rep % 2 == 0 else ("unchecked", "checked"):
                if not a.hot:
                    drop_cache(data_files(out))
                env = dict(os.environ, XDG_CACHE_HOME=str(work / f"cache-{rep}-{mode}"))
                env["HS_DATASET_CHECK_SHARDS"] = "1" if mode == "checked" else "0"
                r = subprocess.run([sys.executable, __file__, "--child", str(out), "--batch", str(a.batch)],
                                   capture_output=True, text=True, env=env, check=True)
                res = json.loads(r.stdout.strip().splitlines()[-1])
                runs[mode].append(res["bytes"] / res["seconds"] / 1e9)
        best = {k: max(v) for k, v in runs.items()}
        result = {"setup": {"samples": shape.samples, "tokens": a.tokens, "hidden": a.hidden, "states": 4,
                            "payload_gb": round(shape.payload / 1e9, 2), "shards": len(data_files(out)),
                            "page_cache": "hot" if a.hot else "dropped before each run", "reps": reps,
                            "cpus": os.cpu_count()},
                  "GB/s": {k: {"best": round(best[k], 3), "median": round(statistics.median(v), 3),
                               "all": [round(x, 3) for x in v]} for k, v in runs.items()},
                  "ratio_checked_to_unchecked": round(statistics.geometric_mean(
                      [c / u for c, u in zip(runs["checked"], runs["unchecked"])]), 3),
                  "ratio_of_bests": round(best["checked"] / best["unchecked"], 3)}
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
