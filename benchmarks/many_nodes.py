#!/usr/bin/env python
"""Many nodes from one published version (issue 52): what an epoch fetches, what the caches hold, how fast it reads.

    python benchmarks/many_nodes.py             # 64 shards of 2 MiB (H=1024, 256 tokens, 3 layers + final)
    python benchmarks/many_nodes.py --quick     # 16 shards, seconds (the smoke test)

A build of random states is pushed to a local S3-compatible server (moto's server mode, in a process of its
own on 127.0.0.1, the real s3fs client) and read by ``open_ranked`` as 2 nodes x 2 ranks (each node its own
cache folder, bounded at a quarter of the version: smaller than the version), every rank one epoch. In one run:

* FETCHED: bytes fetched over all nodes in the epoch / the version's shard bytes (target <= 1.05);
* CACHE: the most bytes each node's cache held and reserved at once / its bound (target <= 1.0);
* THROUGHPUT: rows per second of one rank reading the whole version (world size 1, rows decoded by
  ``decode_row``) from its cache, against ``iter_torch(open_dataset(copy))`` of a local copy of the same version
  on the same machine (target >= 0.8x): the reader's own cost. Beside it, in the same run, the rank fetching
  from the server through the bounded cache, against the store's own pace (every shard fetched in turn,
  nothing else: ``cold_vs_raw_fetch`` near 1 means the prefetch hides the decoding behind the fetches; the
  store's bandwidth, not the reader, bounds a cold epoch). Best of ``--reps`` each, interleaved.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from save_report import save_report  # noqa: E402

TARGETS = {"fetched_over_version": 1.05, "peak_cache_over_bound": 1.0, "throughput_vs_local": 0.8}
BUCKET = "hs-bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_s3() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in a process of its own (not this one's GIL), its bucket made; -> (process, endpoint)."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint, FSSPEC_S3_ENDPOINT_URL=endpoint, NO_PROXY="127.0.0.1,localhost")
    import boto3

    for _ in range(100):
        try:
            boto3.client("s3").create_bucket(Bucket=BUCKET)
            return proc, endpoint
        except Exception:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto's server did not start")


def make_build(work: Path, samples: int, tokens: int, hidden: int) -> Path:
    import storage

    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.write.driver import build

    shape = storage.Shape(hidden, 3, tokens, samples)
    model = storage.make_model_dir(work / "model", hidden)
    source = storage.make_source(work / "src.jsonl", samples, tokens)
    out = work / "build"
    build(HiddenStatesConfig(model=str(model), layers=shape.layers(), source=str(source), max_length=tokens,
                             part_size=1),
          out, backend=storage.PrecomputedBackend(model, shape.layers(), storage.make_states(shape)), progress=False)
    return out


def touch(rows: list[dict]) -> int:
    """Read every state tensor's bytes once (what a collator's copy does), -> rows."""
    for r in rows:
        for v in r.values():
            if hasattr(v, "view") and getattr(v, "ndim", 0) == 2:
                float(v[-1, -1])
    return len(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    samples, tokens, hidden = (16, 64, 256) if a.quick else (64, 256, 1024)

    from hs_dataset.hub.object_push import push_objects
    from hs_dataset.read import iter_torch, open_dataset
    from hs_dataset.read.ranked import open_ranked

    proc, endpoint = start_s3()
    try:
        with tempfile.TemporaryDirectory(prefix="hs-many-nodes-") as tmp:
            work = Path(tmp)
            os.environ["XDG_CACHE_HOME"] = str(work / "xdg")
            out = make_build(work, samples, tokens, hidden)
            shard_bytes = sum(p.stat().st_size for p in (out / "data").iterdir())
            url = f"s3://{BUCKET}/bench"
            push_objects(out, url, "v1.0")

            bound = shard_bytes // 4  # per node: smaller than the version
            fetched, peaks = 0, []
            ids: list[str] = []
            for node in range(2):
                node_peak = 0
                for lr in range(2):
                    rd = open_ranked(url, revision="v1.0", cache_dir=work / f"node-{node}", cache_bytes=bound,
                                     batch_size=4, seed=0, rank=2 * node + lr, world_size=4, local_rank=lr,
                                     local_world_size=2)
                    ids += [r["id"] for b in rd for r in b]
                    fetched += rd.cache.fetched_bytes
                    node_peak += rd.cache.peak_bytes
                    rd.cache.close()
                peaks.append(node_peak)
            assert sorted(ids) == sorted(set(ids)) and len(ids) == samples, "an epoch must read every row once"

            copy = open_dataset(url, revision="v1.0", local_dir=work / "copy")
            import fsspec

            fs, root = fsspec.core.url_to_fs(url)
            times: dict[str, list[float]] = {"local": [], "warm": [], "cold": [], "raw_fetch": []}
            for rep in range(a.reps):
                t = time.perf_counter()
                assert sum(touch([r]) for r in iter_torch(copy, batch_size=4)) == samples
                times["local"].append(time.perf_counter() - t)
                t = time.perf_counter()  # the store's own pace: every shard fetched in turn, nothing else
                for p in sorted((out / "data").iterdir()):
                    fs.get_file(f"{root}/versions/v1.0/data/{p.name}", str(work / f"raw-{p.name}"))
                times["raw_fetch"].append(time.perf_counter() - t)
                for k, b in (("cold", bound), ("warm", 2 * shard_bytes)):
                    rd = open_ranked(url, revision="v1.0", cache_dir=work / f"{k}-{rep}", cache_bytes=b,
                                     batch_size=4, seed=rep, rank=0, world_size=1, local_rank=0, local_world_size=1)
                    if k == "warm":  # epoch 0 fills the cache; epoch 1 reads it: the reader's own cost
                        assert sum(len(x) for x in rd) == samples
                        rd.set_epoch(1)
                    t = time.perf_counter()
                    assert sum(touch(x) for x in rd) == samples
                    times[k].append(time.perf_counter() - t)
                    rd.cache.close()
    finally:
        proc.kill()
        proc.wait()

    best = {k: min(v) for k, v in times.items()}
    figures = {"fetched_over_version": fetched / shard_bytes, "peak_cache_over_bound": max(peaks) / bound,
               "throughput_vs_local": best["local"] / best["warm"]}
    report = {
        "date": dt.date.today().isoformat(), "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "command": "python benchmarks/many_nodes.py" + (" --quick" if a.quick else ""),
        "shape": {"samples": samples, "tokens": tokens, "hidden": hidden, "shards": samples,
                  "version_shard_bytes": shard_bytes, "layout": "2 nodes x 2 ranks", "cache_bound_per_node": bound},
        "fetched_bytes_all_nodes": fetched, "peak_cache_bytes_per_node": peaks,
        "rows_per_s": {"open_dataset_local_copy": samples / best["local"],
                       "open_ranked_cached": samples / best["warm"],
                       "open_ranked_fetching_bounded_cache": samples / best["cold"],
                       "store_raw_fetch": samples / best["raw_fetch"]},
        "cold_vs_raw_fetch": round(best["raw_fetch"] / best["cold"], 4),
        "figures": {k: round(v, 4) for k, v in figures.items()},
        "targets": TARGETS,
        "pass": {k: (v <= TARGETS[k] if k != "throughput_vs_local" else v >= TARGETS[k]) for k, v in figures.items()},
    }
    print(json.dumps(report, indent=1))
    if not a.quick:
        save_report(report, "many-nodes")
    return 0 if all(report["pass"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
