#!/usr/bin/env python
"""The tokenize stage's rate with a Kimi-packaged tokenizer (issue 28): tiktoken under a slow Python
``PreTrainedTokenizer``, behind ``trust_remote_code``, as Kimi-K2.5 ships it.

    python benchmarks/tokenize_rate.py                          # 2000 conversations, serial vs 2 workers
    python benchmarks/tokenize_rate.py --rows 12000 --workers 2 --reps 3
    python benchmarks/tokenize_rate.py --compare-with OLD_TREE  # also an older checkout's serial stage

The tokenizer is :func:`hs_dataset.demo.tiny_kimi.make_kimi_tokenizer`'s (made locally; the same
directory for every run); the conversations are made here, deterministically (1-3 turns, a system
prompt in some, replies of 60-500 words of this repository's README). Each mode runs
:func:`hs_dataset.prepare.samples.tokenized_samples` over the whole source in a fresh process:
``serial`` (``tokenize_workers=0``), ``workers`` (``--workers`` processes; their start, importing
transformers and loading the tokenizer, is timed apart: ``start_s``), and, with ``--compare-with``, the
serial stage of another checkout (its ``hs_dataset`` on ``PYTHONPATH``), the raw baseline of "today".
Modes are interleaved, best of ``--reps``; a shared VM swings single runs. Rates are tokens written
per second of wall time, and, because a loaded machine lends the workers no free core, also the rate
the measured CPU time gives on idle cores (``idle_tok_per_s``: the workers' CPU seconds during the
run, from ``/proc``, spread over ``min(workers, cores)`` cores, never faster than the main process's
own CPU seconds; serial: one core). The JSON report goes to ``benchmarks/results/`` and to ``$OUT`` when set.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_MEASURE = r"""
import json, multiprocessing, os, sys, time
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.prepare.samples import tokenized_samples
from hs_dataset.prepare.source_spec import resolve_source
from hs_dataset.prepare.tokenizer import load_tokenizer
tok_dir, source, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = load_tokenizer(tok_dir, trust_remote_code=True)
config = HiddenStatesConfig(model=tok_dir, source=source, layers=(0,), max_length=2048, trust_remote_code=True)
kw, start, pids = {}, 0.0, []


def cpu_of(pids):
    # utime + stime of these processes, from /proc: the workers' own CPU seconds
    ticks = os.sysconf("SC_CLK_TCK")
    fields = [open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split() for p in pids]
    return sum((int(f[11]) + int(f[12])) / ticks for f in fields)


if workers:
    from hs_dataset.prepare.workers import TokenizeWorkers, tokenizer_identity
    t = time.perf_counter()
    pool = TokenizeWorkers(workers, tok_dir, trust_remote_code=True, identity=tokenizer_identity(tok))
    pool._check()
    start = time.perf_counter() - t
    kw = {"workers": pool}
    pids = [p.pid for p in multiprocessing.active_children()]
rejects = []
w0 = cpu_of(pids)
t, c = time.perf_counter(), time.process_time()
tokens = samples = 0
for _, s in tokenized_samples(resolve_source(config.source), config, tok, len(tok), [(0, None)],
                              lambda i, r: rejects.append(r), **kw):
    tokens += s.num_tokens
    samples += 1
wall, cpu = time.perf_counter() - t, time.process_time() - c
children = cpu_of(pids) - w0
if workers:
    pool.close()
print(json.dumps({"tokens": tokens, "samples": samples, "rejects": len(rejects), "wall_s": wall,
                  "main_cpu_s": cpu, "workers_cpu_s": children, "start_s": start}))
"""


def make_source(path: Path, rows: int) -> Path:
    """``rows`` OpenAI-shape conversations of README prose (seeded: the same file every run)."""
    words = re.findall(r"\S+", (ROOT / "README.md").read_text(encoding="utf-8"))
    rnd = random.Random(0)

    def para(n: int) -> str:
        i = rnd.randrange(len(words) - n)
        return " ".join(words[i:i + n])

    with open(path, "w", encoding="utf-8") as f:
        for _ in range(rows):
            msgs = [{"role": "system", "content": "You are a helpful assistant."}] if rnd.random() < 0.3 else []
            for _ in range(rnd.choice([1, 1, 2, 3])):
                msgs.append({"role": "user", "content": para(rnd.randint(20, 150))})
                msgs.append({"role": "assistant", "content": para(rnd.randint(60, 500))})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def measure(tree: Path, tok_dir: Path, source: Path, workers: int, cores: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    r = subprocess.run([sys.executable, "-c", _MEASURE, str(tok_dir), str(source), str(workers)], env=env,
                       capture_output=True, text=True, timeout=7200, cwd=str(tree))
    if r.returncode != 0:
        raise SystemExit(f"measurement in {tree} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["tok_per_s"] = out["tokens"] / out["wall_s"]
    # What the same work would run at on `cores` idle cores: the workers' CPU spread over the cores, but never
    # faster than the main process alone (it reads and hands out every row); serial: one core's rate.
    cpu = out["main_cpu_s"] + out["workers_cpu_s"]
    out["cpu_s_per_mtok"] = cpu / out["tokens"] * 1e6
    out["idle_tok_per_s"] = out["tokens"] / (max(cpu / cores, out["main_cpu_s"]) if workers else out["main_cpu_s"])
    out["warnings"] = [line for line in r.stderr.splitlines() if line.strip()][:5]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000, help="conversations (default 2000)")
    ap.add_argument("--workers", type=int, default=2, help="tokenize worker processes (default 2)")
    ap.add_argument("--reps", type=int, default=3, help="runs of each mode, interleaved; the best counts")
    ap.add_argument("--compare-with", type=Path, metavar="TREE",
                    help="a checkout whose serial tokenize stage is the baseline (e.g. `git archive main`)")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from hs_dataset.demo.tiny_kimi import make_kimi_tokenizer

    with tempfile.TemporaryDirectory(prefix="hs-tokenize-") as d:
        tok_dir = make_kimi_tokenizer(Path(d) / "kimi")
        source = make_source(Path(d) / "conversations.jsonl", a.rows)
        modes = {"serial": (ROOT, 0), f"workers={a.workers}": (ROOT, a.workers)}
        if a.compare_with is not None:
            modes = {"baseline (--compare-with, serial)": (a.compare_with.resolve(), 0), **modes}
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        cores = len(os.sched_getaffinity(0))
        for rep in range(a.reps):
            for name, (tree, workers) in modes.items():
                runs[name].append(measure(tree, tok_dir, source, workers, min(workers, cores) or 1))
                r = runs[name][-1]
                print(f"rep {rep + 1} {name}: {r['tok_per_s']:,.0f} tok/s ({r['tokens']:,} tokens, {r['samples']} "
                      f"samples, {r['wall_s']:.1f}s, start {r['start_s']:.1f}s; {r['cpu_s_per_mtok']:.2f} CPU-s per "
                      f"million tokens, {r['idle_tok_per_s']:,.0f} tok/s on idle cores)", flush=True)
    best = {m: max(rs, key=lambda r: r["tok_per_s"]) for m, rs in runs.items()}
    best_idle = {m: max(rs, key=lambda r: r["idle_tok_per_s"]) for m, rs in runs.items()}
    base_name = next(iter(modes))
    base, base_idle = best[base_name]["tok_per_s"], best_idle[base_name]["idle_tok_per_s"]
    report = {
        "benchmark": "tokenize", "date": dt.date.today().isoformat(), "rows": a.rows, "reps": a.reps,
        "cores": cores, "load_average": os.getloadavg(), "baseline": base_name,
        "best": best, "ratio_to_baseline": {m: r["tok_per_s"] / base for m, r in best.items()},
        "idle_ratio_to_baseline": {m: r["idle_tok_per_s"] / base_idle for m, r in best_idle.items()},
        "runs": runs,
    }
    print("wall, best of each:", json.dumps({m: round(v, 2) for m, v in report["ratio_to_baseline"].items()}))
    print("on idle cores (from CPU time):", json.dumps({m: round(v, 2) for m, v in
                                                        report["idle_ratio_to_baseline"].items()}))
    from save_report import save_report

    save_report(report, "tokenize")
    return 0


if __name__ == "__main__":
    sys.exit(main())
