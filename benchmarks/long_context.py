#!/usr/bin/env python3
"""Long context at Kimi width through SGLang (issue 25; run on a GPU).

The stand-in is ``.gpu/make_kimi_width.py DIR --long-context``: DeepSeek-V3 at Kimi-K2.5's width
(hidden 7168, 6 layers, 3.4B) with Kimi-K2's YaRN positions (131,072). Layers 1, 3, 4 + final:
57,344 bytes of states per token. For each size (one 32,768-token sample, one 131,072-token sample,
64 samples of 8,192 tokens) one engine (chunked prefill) measures, in this order:

  plain    the engine's prefill of the same token ids, max_new_tokens=1, with request ids that are
           not ours (the plugin passes them through: measured >= 0.97x of an engine without it)
  capture  with --capture: capture + transport alone, the states through the ring (windowed for the
           131k sample) and dropped, nothing written (the build below does the same and writes)
  build    hs_dataset's build() (the same code as ``hs-dataset build``, given the started backend) of
           a source whose rows tokenize to exactly that many tokens, onto the disk; its peak RSS
           above the process's RSS before it, and the ring it used

and right after the 32k build its states at the first, middle and last 1,024 positions against the
transformers reference on the same GPU (a chunked forward over a KV cache); after the 131k build
``hs-dataset verify`` of it, ``load_dataset(dir, streaming=True)``, ``open_dataset`` and a
16,384-token window read with its file's page cache dropped (bytes read from disk, /proc/self/io),
and its last 1,024 positions against the reference with --parity-131k; then the disk's write rate.

    source .gpu/device-setup.sh && pip install --no-deps --no-build-isolation --no-index -e .
    python benchmarks/long_context.py --json $OUT/long-context.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from kimi_width import ENGINE_ARGS, LAYERS, source
from sglang_extraction import disk_write_rate

ROOT = Path(__file__).resolve().parent.parent
HIDDEN = 7168


def rss() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) * 1024


class PeakRSS:
    """The process's peak RSS while the block runs, sampled every 20 ms."""

    def __enter__(self) -> "PeakRSS":
        self.before = self.peak = rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes")).split()[1])


def drop_cache(directory: Path) -> None:
    for f in directory.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def compare(got, ref) -> dict:
    import torch

    g, r = got.float(), ref.float()
    cos = torch.nn.functional.cosine_similarity(g, r, dim=-1)
    return {"mean_cos": round(cos.mean().item(), 6), "min_cos": round(cos.min().item(), 6),
            "rel_err": round(((g - r).abs().mean() / r.abs().mean()).item(), 5)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/kimi-width-lc")
    ap.add_argument("--work", default="/tmp/hs-long")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sizes", default="32768x1,131072x1,8192x64", help="TOKENSxSAMPLES, comma separated")
    ap.add_argument("--reps", type=int, default=1, help="plain runs (and capture runs with --capture) per size")
    ap.add_argument("--capture", action="store_true", help="also time capture + transport alone (the build does it too)")
    ap.add_argument("--chunk", type=int, default=16384, help="SGLang chunked_prefill_size")
    ap.add_argument("--parity-131k", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=540, help="skip the optional steps after this")
    ap.add_argument("--compact", type=int, default=0,
                    help="then benchmarks/compact.py's table on the same engine, with this many 2k samples (0: skip)")
    ap.add_argument("--compact-first", action="store_true", help="run the compact table before the long samples")
    a = ap.parse_args()
    t_start = time.time()
    # 131,072 prompt positions (SGLang allows context_length - 6 prompt tokens; 131,080 leaves room) + the 1 new token: YaRN's
    # 131,072 positions are all a prompt uses, the new token is sampled from the last prefill position
    os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    import torch

    from hs_dataset.capture.sglang.backend import SGLangBackend
    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.demo.tiny import make_tiny_tokenizer
    from hs_dataset.prepare.samples import tokenized_samples
    from hs_dataset.write.driver import build
    from hs_dataset.write.resolve import resolve_build

    res: dict = {"gpu": torch.cuda.get_device_name(), "layers": list(LAYERS), "bytes_per_token": 4 * HIDDEN * 2,
                 "chunked_prefill_size": a.chunk}

    def dump() -> None:
        print(json.dumps(res), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))

    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = Path(a.model)
    t = time.time()
    if not (model / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / ".gpu" / "make_kimi_width.py"), str(model), "--long-context"],
                       check=True)
        make_tiny_tokenizer(model, template="chatml")
    res["model_make_s"] = round(time.time() - t, 1)
    res["disk_write_MBps"] = round(disk_write_rate(work / "probe") / 1e6)
    sizes = [tuple(int(x) for x in s.split("x")) for s in a.sizes.split(",")]
    configs = {}
    for tokens, n in sizes:
        src = source(work / f"src-{tokens}.jsonl", n, tokens, seed=tokens)
        configs[tokens] = HiddenStatesConfig(model=str(model), layers=LAYERS, source=str(src), max_length=tokens,
                                             part_size=16, backend="sglang")
    t = time.time()
    be = SGLangBackend(str(model), LAYERS, max_inflight=32, chunked_prefill_size=a.chunk, engine_args=ENGINE_ARGS)
    res["engine_start_s"] = round(time.time() - t, 1)
    res["ring_GiB"] = round(be.ring.capacity / 2**30, 2)
    res["window_rows"] = be.window_rows(configs[sizes[0][0]].row_tokens)
    dump()

    def plain(samples) -> float:
        t = time.time()
        futs = [be._submit(f"plain-{time.time_ns()}-{i}", s.input_ids.tolist()) for i, s in enumerate(samples)]
        for f in futs:
            f.result()
        return time.time() - t

    def capture(samples, row_tokens) -> tuple[float, int]:
        t, n = time.time(), 0
        for r in be.capture(samples, row_tokens=row_tokens, max_tokens=max(s.num_tokens for s in samples)):
            n += r.states.numel() * r.states.element_size()
            del r
        return time.time() - t, n

    # Parity at long range: the transformers reference on the same GPU (the engine's static memory leaves room),
    # chunked over a KV cache; and the 131k build's checks. Run right after each build.
    from hs_dataset.capture.transformers import TransformersBackend
    from hs_dataset.integrity.verify import verify_build
    from hs_dataset.read.open import open_dataset
    from hs_dataset.read.windows import read_window, sample_rows

    def parity(tokens: int, spans: list[tuple[int, int]], chunk: int) -> dict:
        cfg = configs[tokens]
        r = resolve_build(cfg)
        (sample,) = [s for _, s in tokenized_samples(cfg, r.tokenizer, r.vocab_size, [(0, 1)], lambda *_: None)]
        t = time.time()
        ref = TransformersBackend(str(model), LAYERS, device="cuda", prefill_chunk=chunk)
        want = ref._run_chunked(sample, chunk).states  # [4, T, H] on the CPU
        ref.close()
        del ref
        torch.cuda.empty_cache()
        ds = open_dataset(work / f"build-{tokens}")
        (s,) = sample_rows(ds)
        cols = [f"hidden_layer_{k}" for k in LAYERS] + ["hidden_final"]
        got = {}
        for lo, hi in spans:
            w = read_window(ds, s, lo, hi)
            got[f"{lo}-{hi}"] = {c: compare(w[c], want[j, lo:hi]) for j, c in enumerate(cols)}
        return {"seconds": round(time.time() - t, 1), "chunk": chunk, "spans": got}

    def checks_131k(out131: Path) -> None:
        import datasets

        t = time.time()
        rep = verify_build(out131)
        res["verify_131k"] = {"ok": rep.ok, "seconds": round(time.time() - t, 1)}
        t = time.time()
        stream = datasets.load_dataset(str(out131), split="train", streaming=True)
        first = next(iter(stream))
        res["streaming_131k"] = {"first_row_tokens": len(first["input_ids"]), "seconds": round(time.time() - t, 1)}
        ds = open_dataset(out131)
        (s,) = sample_rows(ds)
        for start in s.starts:  # the one-time hash check of every shard the sample spans, before the measure
            read_window(ds, s, start, start + 1)  # (its first device run read a whole unchecked shard: 4.7 GB)
        drop_cache(out131 / "data")
        b = read_bytes()
        t = time.time()
        w = read_window(ds, s, 65536, 65536 + 16384)
        touched = sum(float(w[c].float().sum()) for c in w if c.startswith("hidden_"))
        res["window_16k_of_131k"] = {"bytes_read_GB": round((read_bytes() - b) / 1e9, 3),
                                     "window_GB": round(16384 * res["bytes_per_token"] / 1e9, 3),
                                     "sample_GB": round(131072 * res["bytes_per_token"] / 1e9, 2),
                                     "seconds": round(time.time() - t, 2), "finite": bool(np.isfinite(touched)),
                                     "rows_of_sample": len(s.starts)}
        dump()

    def compact(disk_rate: float) -> None:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import compact as table

        table.run(be, model, work / "compact", a.compact, res, dump, disk_rate=disk_rate,
                  deadline=t_start + a.deadline_s)

    if a.compact and a.compact_first:
        compact(res["disk_write_MBps"] * 1e6)
    res["sizes"] = {}
    for tokens, n in sizes:
        if time.time() - t_start > a.deadline_s:
            res.setdefault("skipped", []).append(tokens)
            continue
        cfg = configs[tokens]
        r = resolve_build(cfg)
        samples = [s for _, s in tokenized_samples(cfg, r.tokenizer, r.vocab_size, [(0, n)], lambda *_: None)]
        assert all(s.num_tokens == tokens for s in samples), [s.num_tokens for s in samples]
        total = tokens * n
        if tokens <= 32768:
            plain(samples[:1])  # warm-up: kernels for this length (the longest runs after the others' warm-ups)
        out: dict = {"samples": n, "tokens": total, "sample_GB": round(tokens * res["bytes_per_token"] / 1e9, 2)}
        runs_p, runs_c = [], []
        for _ in range(a.reps):
            runs_p.append(total / plain(samples))
            if a.capture:
                dt, nbytes = capture(samples, r.row_tokens)
                runs_c.append(total / dt)
        out["plain_tok_s"] = round(max(runs_p))
        out["runs"] = {"plain": [round(x) for x in runs_p]}
        if runs_c:
            out["capture_tok_s"] = round(max(runs_c))
            out["capture/plain"] = round(max(runs_c) / max(runs_p), 3)
            out["runs"]["capture"] = [round(x) for x in runs_c]
        dump()
        dst = work / f"build-{tokens}"
        stats0 = be.plugin_stats() or {}
        with PeakRSS() as m:
            t = time.time()
            s = build(cfg, dst, backend=be, progress=False)
            dt = time.time() - t
        stats1 = be.plugin_stats() or {}
        out["build_tok_s"] = round(s.counts.tokens_written / dt)
        out["build/plain"] = round(out["build_tok_s"] / out["plain_tok_s"], 3)
        out["build_rows"] = s.counts.rows_written
        out["build_GB"] = round(s.bytes_written / 1e9, 2)
        out["builder_peak_rss_above_start_GB"] = round((m.peak - m.before) / 1e9, 2)
        out["builder_rss_before_GB"] = round(m.before / 1e9, 2)
        out["room_wait_s"] = round(stats1.get("room_wait_s", 0) - stats0.get("room_wait_s", 0), 2)
        res["sizes"][str(tokens)] = out
        dump()
        try:
            if tokens == 32768:
                res["parity_32k"] = parity(32768, [(0, 1024), (16384 - 512, 16384 + 512), (32768 - 1024, 32768)], 1024)
                dump()
            elif tokens == 131072:
                checks_131k(dst)
                if a.parity_131k and time.time() - t_start < a.deadline_s - 150:
                    res["parity_131k"] = parity(131072, [(131072 - 1024, 131072)], 512)
                    dump()
        except Exception as e:  # recorded, and the next size runs
            res.setdefault("errors", []).append(f"after the {tokens} build: {type(e).__name__}: {e}"[:800])
            dump()
        shutil.rmtree(dst)  # the device has 64 GiB of disk
    if a.compact and not a.compact_first:
        compact(res["disk_write_MBps"] * 1e6)
    res["plugin_stats"] = be.plugin_stats()
    be.close()
    for k, out in res["sizes"].items():
        disk_tok_s = res["disk_write_MBps"] * 1e6 / res["bytes_per_token"]
        out["build/min(plain,disk)"] = round(out["build_tok_s"] / min(out["plain_tok_s"], disk_tok_s), 3)
    dump()

    res["peak_rss_process_GB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
    res["wall_s"] = round(time.time() - t_start, 1)
    dump()


if __name__ == "__main__":
    main()
