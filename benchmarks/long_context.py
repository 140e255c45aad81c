#!/usr/bin/env python3
"""Long context at Kimi width through SGLang (issue 25; run on a GPU).

The stand-in is ``.gpu/make_kimi_width.py DIR --long-context``: DeepSeek-V3 at Kimi-K2.5's width
(hidden 7168, 6 layers, 3.4B) with Kimi-K2's YaRN positions (131,072). Layers 1, 3, 4 + final:
57,344 bytes of states per token. For each size (one 32,768-token sample, one 131,072-token sample,
64 samples of 8,192 tokens) one server (``python -m sglang.launch_server`` with the plugin, chunked
prefill, started once) measures, in this order:

  plain    the server's prefill of the same token ids, max_new_tokens=1, with request ids that are
           not ours (the plugin passes them through: measured >= 0.97x of an engine without it), sent
           by this process attached to the server (``SGLangBackend(sglang_url=...)``)
  capture  with --capture N: capture + transport alone for sizes up to N tokens, the states through this
           process's ring (windowed past its window) and dropped, nothing written (a 131k sample's build,
           prefill-bound, measures it: an in-process 131k build ran at 0.99x of plain on 2026-12-03)
  build    ``hs-dataset build`` (the CLI, a process of its own, attached to the same server: attach
           mode, README) of a source whose rows tokenize to exactly that many tokens, onto the disk;
           build tok/s from its summary line (the build's own seconds) and from its process's wall
           time; the builder's peak RSS (``VmHWM`` of the CLI process) and the peak of its process
           tree's RSS (its tokenize workers included), and the ring it used

and right after the 32k build its states at the first, middle and last 1,024 positions against the
transformers reference on the same GPU (a chunked forward over a KV cache); after the 131k build
``hs-dataset verify`` of it, ``load_dataset(dir, streaming=True)``, ``open_dataset`` and a
16,384-token window read with its file's page cache dropped (bytes read from disk, /proc/self/io),
and, before those, its last 1,024 positions against the reference with --parity-131k (a forward of
all 131,072 positions, 128 at a time over a cache allocated once: 32 GB of keys and values beside the
server's memory); then the disk's write rate.

    source .gpu/device-setup.sh && python3 -m pip install --no-deps --no-build-isolation --no-index -e .
    python benchmarks/long_context.py --json $OUT/long-context.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from kimi_width import ENGINE_ARGS, LAYERS, source
from sglang_extraction import disk_write_rate

ROOT = Path(__file__).resolve().parent.parent
HIDDEN = 7168


def _status_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(next(line for line in f if line.startswith(field)).split()[1])
    except (OSError, StopIteration):
        return 0


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def run_cli(cmd: list[str], log: Path) -> dict:
    """Run the CLI; its wall time, exit code, peak RSS (``VmHWM``, read until it exits) and the peak of its
    process tree's summed RSS (sampled every 20 ms)."""
    t = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        hwm = tree = 0
        while proc.poll() is None:
            hwm = max(hwm, _status_kb(proc.pid, "VmHWM"))
            tree = max(tree, sum(_status_kb(p, "VmRSS") for p in _tree(proc.pid)))
            time.sleep(0.02)
    return {"rc": proc.returncode, "wall_s": round(time.time() - t, 1), "peak_rss_GB": round(hwm * 1024 / 1e9, 2),
            "peak_tree_rss_GB": round(tree * 1024 / 1e9, 2), "output_tail": log.read_text()[-600:]}


def launch_server(model: Path, ring_dir: Path, chunk: int, log: Path) -> tuple[subprocess.Popen, str]:
    """``python -m sglang.launch_server`` with the plugin capturing LAYERS into ``ring_dir`` (README: attach mode)."""
    from hs_dataset.capture.transport import ENV

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = dict(ENGINE_ARGS, chunked_prefill_size=chunk)
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(port),
           "--disable-radix-cache", "--skip-tokenizer-init", "--log-level", "warning"]
    for k, v in args.items():
        cmd += [f"--{k.replace('_', '-')}"] if v is True else [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, **{ENV: json.dumps({"layers": list(LAYERS), "dir": str(ring_dir)})})
    server = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return server, url
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"sglang.launch_server did not come up (exit {server.poll()}): "
                                   f"{log.read_text()[-2000:]}")
            time.sleep(1)


def stop_server(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


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
    ap.add_argument("--capture", type=int, default=0, metavar="TOKENS",
                    help="also time capture + transport alone for sizes up to this many tokens (0: none)")
    ap.add_argument("--chunk", type=int, default=16384, help="SGLang chunked_prefill_size")
    ap.add_argument("--measure-only", default="", help="sizes (tokens, comma separated) timed plain/capture, not built")
    ap.add_argument("--build-only", default="", help="sizes built (and checked), not timed plain/capture first")
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

    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.demo.tiny import make_tiny_tokenizer

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
    ring_dir = Path("/dev/shm/hs-long-rings")
    shutil.rmtree(ring_dir, ignore_errors=True)
    ring_dir.mkdir()
    t = time.time()
    server, url = launch_server(model, ring_dir, a.chunk, work / "server.log")
    try:
        _run(a, res, dump, t_start, t, model, work, sizes, configs, url, ring_dir)
    finally:
        stop_server(server)
        shutil.rmtree(ring_dir, ignore_errors=True)
    res["peak_rss_process_GB"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
    res["wall_s"] = round(time.time() - t_start, 1)
    dump()


def _run(a, res, dump, t_start, t, model, work, sizes, configs, url, ring_dir) -> None:
    """The sizes, on the started server (see the module docstring)."""
    import torch

    from hs_dataset.capture.sglang.backend import SGLangBackend
    from hs_dataset.prepare.samples import tokenized_samples
    from hs_dataset.write.resolve import resolve_build

    be = SGLangBackend(str(model), LAYERS, max_inflight=32, sglang_url=url, ring_dir=str(ring_dir))
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
        (sample,) = [s for _, s in tokenized_samples(r.source, cfg, r.tokenizer, r.vocab_size, [(0, 1)], lambda *_: None)]
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
        samples = [s for _, s in tokenized_samples(r.source, cfg, r.tokenizer, r.vocab_size, [(0, n)], lambda *_: None)]
        assert all(s.num_tokens == tokens for s in samples), [s.num_tokens for s in samples]
        total = tokens * n
        out: dict = {"samples": n, "tokens": total, "sample_GB": round(tokens * res["bytes_per_token"] / 1e9, 2)}
        res["sizes"][str(tokens)] = out
        if str(tokens) not in a.build_only.split(","):
            if tokens <= 32768:
                plain(samples[:1])  # warm-up: kernels for this length (the longest runs after the others' warm-ups)
            runs_p, runs_c = [], []
            for _ in range(a.reps):
                runs_p.append(total / plain(samples))
                if tokens <= a.capture:
                    dt, nbytes = capture(samples, r.row_tokens)
                    runs_c.append(total / dt)
            out["plain_tok_s"] = round(max(runs_p))
            out["runs"] = {"plain": [round(x) for x in runs_p]}
            if runs_c:
                out["capture_tok_s"] = round(max(runs_c))
                out["capture/plain"] = round(max(runs_c) / max(runs_p), 3)
                out["runs"]["capture"] = [round(x) for x in runs_c]
            dump()
        if str(tokens) in a.measure_only.split(","):
            continue
        dst = work / f"build-{tokens}"
        script = work / f"build-{tokens}.py"  # the builder script the CLI takes: attached to the server
        script.write_text("CONFIG = " + repr(dict(
            model=str(model), layers=list(LAYERS), source=cfg.source, max_length=tokens, part_size=16, backend="sglang",
            backend_options={"sglang_url": url, "ring_dir": str(ring_dir), "max_inflight": 32})) + "\n")
        cli = shutil.which("hs-dataset")
        cmd = [cli] if cli else [sys.executable, "-m", "hs_dataset.cli"]
        cmd += ["build", str(script), "--output", str(dst), "--no-progress"]
        stats0 = be.plugin_stats() or {}
        run = run_cli(cmd, work / f"build-{tokens}.log")
        stats1 = be.plugin_stats() or {}
        out["build_command"] = " ".join(["hs-dataset"] + cmd[-5:])
        out["cli"] = run
        m = re.search(r"([\d,]+) tokens, .* in ([\d.]+)s", run["output_tail"])
        if run["rc"] != 0 or m is None:
            res.setdefault("errors", []).append(f"the {tokens} build: exit {run['rc']}: {run['output_tail']}")
            dump()
            continue
        written, seconds = int(m.group(1).replace(",", "")), float(m.group(2))
        meta = json.loads((dst / "hs_dataset.json").read_text())
        out["build_tok_s"] = round(written / seconds)
        out["build_wall_tok_s"] = round(written / run["wall_s"])
        if "plain_tok_s" in out:
            out["build/plain"] = round(out["build_tok_s"] / out["plain_tok_s"], 3)
        out["build_rows"] = sum(f["rows"] for f in meta["shards"])
        out["build_GB"] = round(sum(f["bytes"] for f in meta["shards"]) / 1e9, 2)
        out["builder_peak_rss_GB"] = run["peak_rss_GB"]
        out["builder_peak_rss/sample_GB"] = round(run["peak_rss_GB"] / out["sample_GB"], 3)
        out["room_wait_s"] = round(stats1.get("room_wait_s", 0) - stats0.get("room_wait_s", 0), 2)
        dump()
        try:
            if tokens == 32768:
                res["parity_32k"] = parity(32768, [(0, 1024), (16384 - 512, 16384 + 512), (32768 - 1024, 32768)], 1024)
                dump()
            elif tokens == 131072:
                if a.parity_131k and time.time() - t_start < a.deadline_s - 100:  # before the checks (they ran on 2026-12-03)
                    res["parity_131k"] = parity(131072, [(131072 - 1024, 131072)], 128)
                    dump()
                checks_131k(dst)
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
        if "build_tok_s" in out and "plain_tok_s" in out:
            out["build/min(plain,disk)"] = round(out["build_tok_s"] / min(out["plain_tok_s"], disk_tok_s), 3)
    dump()


if __name__ == "__main__":
    main()
