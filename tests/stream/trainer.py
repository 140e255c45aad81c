"""A trainer process for the stream tests: reads ``open_stream(ADDRESS)`` for some epochs and records
every row it was handed (its id and a digest of all its bytes), checkpointing after each row.

    python -m tests.stream.trainer ADDRESS --ckpt CKPT [--world 2 --rank 1 --dist DIR] [--sleep 0.1]

The checkpoint (``--ckpt``, replaced atomically after each row) holds the rows seen so far and the
stream's ``state_dict()``: a rank killed at any moment and started again with the same arguments
goes on from it, as a training job does from its last checkpoint. ``--dist DIR`` initialises
``torch.distributed`` (gloo, file rendezvous in DIR), so the stream takes the rank and world size
from it. The last line printed is the checkpoint's JSON, with the stream's stats.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch


def digest(row: dict[str, Any]) -> str:
    """sha256 of every value of a decoded row (tensors by their bytes), keys in order."""
    h = hashlib.sha256()
    for k in sorted(row):
        v = row[k]
        h.update(k.encode())
        h.update(v.encode() if isinstance(v, str) else v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def _save(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--world", type=int, default=None)
    ap.add_argument("--dist", default=None, help="torch.distributed file rendezvous folder")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds of 'training' per row")
    ap.add_argument("--write", action="store_true", help="write to every tensor in place (they must be private)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--prefetch", type=int, default=1, help="prefetch_bytes (1: one row ahead)")
    a = ap.parse_args(argv)
    if a.dist:
        torch.distributed.init_process_group("gloo", init_method=f"file://{a.dist}/rendezvous", rank=a.rank,
                                             world_size=a.world)
        rank = world = None  # from torch.distributed
    else:
        rank, world = a.rank, a.world
    from hs_dataset import open_stream

    ds = open_stream(a.address, seed=a.seed, rank=rank, world_size=world, timeout=a.timeout, prefetch_bytes=a.prefetch)
    ckpt: dict[str, Any] = {"epochs": [[] for _ in range(a.epochs)], "restarts": 0}
    if a.ckpt.exists():
        ckpt = json.loads(a.ckpt.read_text())
        ckpt["restarts"] += 1
        ds.load_state_dict(ckpt["state"])
    while ds.epoch < a.epochs:
        epoch = ds.epoch
        for row in ds:
            d = digest(row)  # before any in-place write
            if a.write:
                for v in row.values():
                    if isinstance(v, torch.Tensor):
                        v.add_(1)
            time.sleep(a.sleep)
            ckpt["epochs"][epoch].append([row["id"], d])
            ckpt["state"] = ds.state_dict()
            _save(a.ckpt, ckpt)
    ckpt["state"] = ds.state_dict()
    ckpt["stats"] = ds.stats
    ckpt["rank"], ckpt["world"] = ds.rank, ds.world_size
    _save(a.ckpt, ckpt)
    ds.close()
    print(json.dumps(ckpt))
    return ckpt


if __name__ == "__main__":
    main(sys.argv[1:])
