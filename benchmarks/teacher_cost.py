#!/usr/bin/env python3
"""What the teacher's top-k (``hs_dataset.codec.teacher``) costs on the GPU, step by step (issue 26; run on a GPU).

States of width ``--hidden`` (7,168: Kimi-K2.5's) times an output embedding of ``--vocab`` rows (32,000: the
Kimi-width stand-in's; 163,840: Kimi-K2.5's), ``--rows`` positions per call (2,048: one request; 16,384: one
prefill pass), timed with CUDA events, best of ``--reps`` after a warm-up:

  product        ``linear(final, weight)`` alone, bf16 (the least the teacher costs: its matrix product)
  teacher        :func:`~hs_dataset.codec.teacher.teacher_topk` as the plugin calls it (positions per matrix
                 product: ``chunk_rows`` of the vocabulary)
  teacher_chunkN the same with N positions per matrix product, for each N of ``--chunks``
  teacher_segN   the same with the top-k taken among the best segments of N logits (``segment=N``; 0: of the
                 whole vocabulary), for each N of ``--segments``
  teacher_torch  the same with ``kernel=False`` (the PyTorch path: float32 logits, their logsumexp and top-k)
  steps          the PyTorch path's steps on one chunk's logits: float32 copy, logsumexp, top-k of the float32 and
                 of the bf16 logits; the Triton logsumexp of the bf16 logits, alone and with each segment size's
                 maxima, and the Triton top-k of the best segments (``segment_topk``)

and each as a share of ``product``. The time a 2,048-token sample's product takes is also given against the
engine's prefill of it at ``--prefill-tok-s`` (118,024 tok/s: the stand-in's plain prefill, 2026-12-04).

    python benchmarks/teacher_cost.py --json $OUT/teacher_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hs_dataset.codec.teacher import chunk_rows, segment_for, teacher_topk  # noqa: E402


def best_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 163840])
    ap.add_argument("--rows", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--segments", type=int, nargs="+", default=[0, 32, 64, 128])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefill-tok-s", type=float, default=118024.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("teacher_cost.py needs a CUDA GPU")
    from hs_dataset.codec.teacher import warm_up
    res: dict = {"device": torch.cuda.get_device_name(), "hidden": args.hidden, "k": args.k,
                 "chunk": {v: chunk_rows(v) for v in args.vocab},
                 "segment": {v: segment_for(v, args.k) for v in args.vocab}, "kernel": {}, "cases": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    for vocab in args.vocab:
        res["kernel"][vocab] = warm_up(vocab) or "triton"
        w = (torch.randn(vocab, args.hidden, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        for rows in args.rows:
            x = torch.randn(rows, args.hidden, device="cuda", generator=g).to(torch.bfloat16)
            c = min(rows, chunk_rows(vocab))
            logits = torch.nn.functional.linear(x[:c], w)
            lf = logits.float()
            case = {"vocab": vocab, "rows": rows, "ms": {
                "product": best_ms(lambda: torch.nn.functional.linear(x, w), args.reps),
                "teacher": best_ms(lambda: teacher_topk(x, w, args.k), args.reps),
                "teacher_torch": best_ms(lambda: teacher_topk(x, w, args.k, kernel=False), args.reps),
            }, "chunk_ms": {
                "float32 copy": best_ms(lambda: logits.float(), args.reps),
                "logsumexp float32": best_ms(lambda: torch.logsumexp(lf, -1), args.reps),
                "topk float32": best_ms(lambda: lf.topk(args.k, -1), args.reps),
                "topk bf16": best_ms(lambda: logits.topk(args.k, -1), args.reps),
            }}
            for chunk in args.chunks:
                if chunk <= rows:
                    case["ms"][f"teacher_chunk{chunk}"] = best_ms(lambda: teacher_topk(x, w, args.k, chunk=chunk),
                                                                  args.reps)
            if res["kernel"][vocab] == "triton":
                from hs_dataset.codec.teacher_triton import row_logsumexp, segment_topk
                ids = torch.empty((logits.shape[0], args.k), dtype=torch.int32, device="cuda")
                lp = torch.empty((logits.shape[0], args.k), dtype=torch.float32, device="cuda")
                case["chunk_ms"]["logsumexp bf16 triton"] = best_ms(lambda: row_logsumexp(logits), args.reps)
                for seg in args.segments:
                    case["ms"][f"teacher_seg{seg}"] = best_ms(lambda: teacher_topk(x, w, args.k, segment=seg), args.reps)
                    if seg:
                        s, segmax = row_logsumexp(logits, seg)
                        case["chunk_ms"][f"logsumexp + maxima of {seg}"] = best_ms(lambda: row_logsumexp(logits, seg),
                                                                                  args.reps)
                        case["chunk_ms"][f"topk kernel of the best segments of {seg}"] = best_ms(
                            lambda: segment_topk(logits, segmax, s, seg, ids, lp), args.reps)
            p = case["ms"]["product"]
            case["vs_product"] = {k: round(v / p, 3) for k, v in case["ms"].items()}
            case["product_share_of_prefill"] = round((p / 1000 / rows) * args.prefill_tok_s, 4)
            case["teacher_share_of_prefill"] = round((case["ms"]["teacher"] / 1000 / rows) * args.prefill_tok_s, 4)
            res["cases"].append(case)
            print(json.dumps(case), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
