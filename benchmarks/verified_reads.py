"""What verifying every block as it is read costs (hs_dataset.read.shard_checks): the first epoch of
open_dataset + iter_torch + DrafterCollator over Kimi-shaped rows with the block checks on and off
(HS_DATASET_CHECK_SHARDS=0), each run in a fresh process, runs interleaved in one run of this script; then
the same build pushed to the local test Hub (tests/fakehub) and streamed over HTTP with
open_dataset(repo, streaming=True), checked and unchecked.

    python benchmarks/verified_reads.py --gb 1 --reps 4 --json benchmarks/results/verified-reads.json
    python benchmarks/verified_reads.py --gb 1 --reps 4 --hot       # the shards in the page cache

Prints the throughput of each and the ratio checked / unchecked: the geometric mean over the pairs of runs
(an even number, each order as often: a small VM's disk drifts from one minute to the next).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests.fakehub: the local test Hub
from storage import PrecomputedBackend, Shape, data_files, drop_cache, make_model_dir, make_source, make_states  # noqa: E402

REPO = "bench/verified-reads"
TOKEN = "hf_BenchVerifiedReads0123456789ABCDEFGH"


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


def read_epoch(target: str, batch: int, streaming: bool) -> None:
    """The child: one epoch, prints bytes and seconds as JSON."""
    from hs_dataset.read import DrafterCollator, iter_torch, open_dataset

    start = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    collate, rows, nbytes = DrafterCollator(), [], 0
    for row in iter_torch(open_dataset(target, streaming=streaming), batch_size=1):
        rows.append(row)
        if len(rows) == batch:
            b = collate(rows)
            nbytes += b["hidden_states"].numel() * 2 + b["aux_hidden_states"].numel() * 2
            rows = []
    seconds, use = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"bytes": nbytes, "seconds": seconds, "cpu_seconds": use.ru_utime + use.ru_stime,
                      "epoch_cpu_seconds": use.ru_utime + use.ru_stime - start.ru_utime - start.ru_stime}))


def paired(reps: int, run: Callable[[str], tuple[float, float, float]], warmup: int = 0) -> dict:
    """``warmup`` pairs run and not counted, then ``reps`` pairs (even), each order as often: GB/s of each mode, the
    geometric mean of the ratios, and the CPU seconds of each run, whole (imports included) and of the epoch alone
    (the work itself, steadier than the wall clock on a shared machine: where the reader gets one core, the ratio
    of the walls comes to that ratio)."""
    runs: dict[str, list[float]] = {"checked": [], "unchecked": []}
    cpu: dict[str, list[float]] = {"checked": [], "unchecked": []}
    epoch_cpu: dict[str, list[float]] = {"checked": [], "unchecked": []}
    reps += reps % 2
    for _ in range(warmup):
        for mode in ("checked", "unchecked"):
            run(mode)
    for rep in range(reps):
        for mode in ("checked", "unchecked") if rep % 2 == 0 else ("unchecked", "checked"):
            gbs, cpu_s, epoch_cpu_s = run(mode)
            runs[mode].append(gbs)
            cpu[mode].append(cpu_s)
            epoch_cpu[mode].append(epoch_cpu_s)
    return {"GB/s": {k: {"best": round(max(v), 3), "median": round(statistics.median(v), 3),
                         "all": [round(x, 3) for x in v]} for k, v in runs.items()},
            "ratio_checked_to_unchecked": round(statistics.geometric_mean(
                [c / u for c, u in zip(runs["checked"], runs["unchecked"])]), 3),
            "ratio_of_bests": round(max(runs["checked"]) / max(runs["unchecked"]), 3),
            "cpu_seconds": {k: [round(x, 2) for x in v] for k, v in cpu.items()},
            "cpu_ratio_unchecked_to_checked": round(statistics.median(cpu["unchecked"])
                                                    / statistics.median(cpu["checked"]), 3),
            "epoch_cpu_seconds": {k: [round(x, 3) for x in v] for k, v in epoch_cpu.items()},
            "epoch_cpu_ratio_unchecked_to_checked": round(statistics.median(epoch_cpu["unchecked"])
                                                          / statistics.median(epoch_cpu["checked"]), 3),
            "pairs": reps, "warmup_pairs": warmup}


def child(target: str, batch: int, mode: str, env: dict[str, str],
          streaming: bool = False) -> tuple[float, float, float]:
    env = dict(env, HS_DATASET_CHECK_SHARDS="1" if mode == "checked" else "0")
    cmd = [sys.executable, __file__, "--child", target, "--batch", str(batch)] + (["--streaming"] if streaming else [])
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    res = json.loads(r.stdout.strip().splitlines()[-1])
    return res["bytes"] / res["seconds"] / 1e9, res["cpu_seconds"], res["epoch_cpu_seconds"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=4, help="pairs of local runs (rounded up to an even number)")
    ap.add_argument("--stream-reps", type=int, default=2, help="pairs of streaming runs (0: none)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="pairs run first and not counted (the first runs after the build meet a VM's fresh memory)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--shard-mb", type=int, default=512)
    ap.add_argument("--hot", action="store_true", help="leave the shards in the page cache")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--streaming", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        read_epoch(a.child, a.batch, a.streaming)
        return 0
    shape = Shape(a.hidden, 3, a.tokens, 0)
    shape.samples = max(2, int(a.gb * 2**30 // shape.sample_bytes))
    with tempfile.TemporaryDirectory(prefix="hs-verified-reads-", dir=os.environ.get("TMPDIR", "/var/tmp")) as d:
        work = Path(d)
        out = build_input(work, shape, a.shard_mb)

        def local(mode: str) -> tuple[float, float, float]:
            if not a.hot:
                drop_cache(data_files(out))
            return child(str(out), a.batch, mode, dict(os.environ))

        result = {"setup": {"samples": shape.samples, "tokens": a.tokens, "hidden": a.hidden, "states": 4,
                            "payload_gb": round(shape.payload / 1e9, 2), "shards": len(data_files(out)),
                            "page_cache": "hot" if a.hot else "dropped before each run", "cpus": os.cpu_count(),
                            "load_average_at_start": os.getloadavg()[0],
                            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
                                       f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"},
                  "first_epoch_local": paired(a.reps, local, a.warmup)}
        if a.stream_reps:
            from tests.fakehub.server import running_hub
            from tests.fakehub.tools import client_subprocess_env, hub_client_env

            with running_hub(work / "hub") as hub, hub_client_env(hub, work / "home", token=TOKEN):
                from hs_dataset.hub.publish import push_dataset

                push_dataset(out, REPO, "v1.0")
                env = client_subprocess_env(hub, work / "home", token=TOKEN)
                env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])
                result["streaming_local_test_hub"] = paired(
                    a.stream_reps, lambda mode: child(REPO, a.batch, mode, env, streaming=True), a.warmup)
    print(json.dumps(result, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
