#!/usr/bin/env python3
"""fp8 states decoded on the CPU (the reader's ``fp8_decode``, issue 26's "reader decoded GB/s"): PyTorch's
float8 -> float32 cast, as three calls, against the decode of :func:`hs_dataset.codec.fp8._dequantize_cpu` (a table
of the 256 codes' values with at most ``TABLE_MAX_THREADS`` PyTorch threads, else the cast into the bf16 output;
``--way`` forces one; ``--block``: the table's block).

Both give the same bits (``tests/codec/test_fp8_decode.py``). Measured in one run, interleaved, best of
``--reps``, on Kimi-width states (``--tokens`` x 7,168, 4 states a row):

  state   one [T, H] state of Gaussian values: ``fp8_dequantize`` by the cast, and as it is
  tails   the same with a few channels 30,000x the rest (as residual streams have): most codes are then zeros
          and subnormals (their share is printed), which a decode through float32 subnormals took tens of
          times slower on the H200's host
  row     ``decode_row`` of each row of an fp8 build in /dev/shm (``--samples`` rows: the shard read from
          memory, a fresh bf16 tensor per state), with the decode swapped for the cast, and as it is

Printed: decoded GB/s (bf16 bytes out) for each, and the ratio to the cast. ``--busy N`` runs N processes that keep a
core busy each beside it (as an engine's polling scheduler or a trainer's threads do): a decode made of many
small parallel PyTorch calls waits there for threads that are not running.

    python benchmarks/fp8_decode.py --json benchmarks/results/<date>-<machine>-fp8-decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hs_dataset.codec import encode, fp8  # noqa: E402


def by_cast(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The definition, as PyTorch's cast computes it (the decode before the bits path)."""
    return (bits.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1).float()).to(torch.bfloat16)


def seconds(fn) -> float:
    """One timed call (the runs of the two ways are interleaved by the caller, the best of each kept)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--busy", type=int, default=0, help="processes keeping a core busy each, beside the benchmark")
    ap.add_argument("--block", type=int, default=0, help="values the table decodes a block (default: the decode's own)")
    ap.add_argument("--way", choices=("table", "cast"), default=None, help="the decode's way (default: by the threads)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.block:
        fp8._CPU_BLOCK = args.block
    if args.way:
        fp8.TABLE_MAX_THREADS = 1 << 30 if args.way == "table" else 0
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        run(args)
    finally:
        for p in busy:
            p.kill()


def run(args: argparse.Namespace) -> None:
    from hs_dataset.read.decode import decode_row
    from hs_dataset.read.open import open_dataset
    from tests.fixtures.builds import random_build

    res: dict = {"machine": platform.node(), "threads": torch.get_num_threads(), "busy": args.busy,
                 "way": "table" if torch.get_num_threads() <= fp8.TABLE_MAX_THREADS else "cast",
                 "block": fp8._CPU_BLOCK, "tokens": args.tokens,
                 "hidden": args.hidden, "samples": args.samples, "reps": args.reps}
    x = torch.randn(args.tokens, args.hidden)
    state_bytes = x.numel() * 2
    tails = x.clone()
    tails[:, :4] *= 30000.0  # a few massive channels: the rest are small against each token's scale
    for name, state in (("state", x), ("tails", tails)):
        bits, scale = fp8.fp8_quantize(state.to(torch.bfloat16))
        assert torch.equal(fp8.fp8_dequantize(bits, scale).view(torch.int16), by_cast(bits, scale).view(torch.int16))
        cast_s, bits_s = [], []
        for _ in range(args.reps):  # interleaved
            cast_s.append(seconds(lambda: by_cast(bits, scale)))
            bits_s.append(seconds(lambda: fp8.fp8_dequantize(bits, scale)))
        res[name] = {"cast_gb_s": state_bytes / min(cast_s) / 1e9, "bits_gb_s": state_bytes / min(bits_s) / 1e9,
                     "zero_or_subnormal_codes": float(((bits & 0x78) == 0).float().mean())}

    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        out = random_build(Path(d), samples=args.samples, tokens=args.tokens, hidden=args.hidden,
                           storage_dtype="fp8_e4m3", part_size=args.samples)
        table = open_dataset(out).data.table
        row_bytes = 4 * state_bytes

        def rows() -> None:
            for i in range(table.num_rows):
                decode_row(table, i)

        rows()  # the shard's pages in memory
        cast_r, bits_r = [], []
        for _ in range(args.reps):
            encode.fp8_dequantize = by_cast  # what fp8_decode calls
            try:
                cast_r.append(seconds(rows))
            finally:
                encode.fp8_dequantize = fp8.fp8_dequantize
            bits_r.append(seconds(rows))
        n = table.num_rows * row_bytes
        res["row"] = {"cast_gb_s": n / min(cast_r) / 1e9, "bits_gb_s": n / min(bits_r) / 1e9}
    for k in ("state", "tails", "row"):
        res[k]["ratio"] = res[k]["bits_gb_s"] / res[k]["cast_gb_s"]
        low = res[k].get("zero_or_subnormal_codes")
        print(f"{k:5s}  cast {res[k]['cast_gb_s']:.2f} GB/s  decode {res[k]['bits_gb_s']:.2f} GB/s  "
              f"({res[k]['ratio']:.2f}x)  [{res['way']}, {res['threads']} threads]"
              + (f"  zero/subnormal codes {low:.1%}" if low else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
