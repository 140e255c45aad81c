"""docs/benchmarks.md from benchmarks/results/*.json: one table per benchmark, one row per figure of a run.

    python benchmarks/report.py            # write docs/benchmarks.md
    python benchmarks/report.py --check    # exit 1 when the committed page is not what the results give

Each row: the run's date and machine (from the result's file name, ``DATE-MACHINE-what.json``), the command
(the result's own, or the benchmark's usual one), the figure, and its ratio to the baseline measured in the
same run. A figure a run did not measure has no row. The tests run ``--check`` (tests/package/test_docs.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
KIMI_BYTES = 57344  # bytes of states per token at Kimi-K2.5's width: 4 states x 7168 x 2

Row = tuple[str, float, str, float | None]  # figure, value, unit, ratio to the baseline (None: it is the baseline)


@dataclass(frozen=True)
class Table:
    title: str
    about: str  # what it measures, and against what
    files: str  # a glob under benchmarks/results/
    command: str  # when the result does not record its own
    rows: Callable[[dict[str, Any]], Iterator[Row]]


def _ratio(value: float, base: float | None) -> float | None:
    return value / base if base else None


def kimi_width(d: dict[str, Any]) -> Iterator[Row]:
    plain = d.get("plain_tok_s")
    if not plain:
        return
    yield "plain prefill (the baseline)", plain, "tok/s", None
    names = {"not_ours_tok_s": "the plugin's engine, requests not ours", "capture_tok_s": "capture + transport",
             "build_bf16_mem_tok_s": "build, bf16, into /dev/shm"}
    for key, name in names.items():
        if d.get(key):
            yield name, d[key], "tok/s", _ratio(d[key], plain)
    disk = d.get("disk_write_MBps")
    if disk and d.get("build_bf16_tok_s"):  # onto the disk, against what the disk allows
        yield "build, bf16, onto the disk (vs what the disk allows)", d["build_bf16_tok_s"], "tok/s", _ratio(
            d["build_bf16_tok_s"], disk * 1e6 / KIMI_BYTES)


def compact(d: dict[str, Any]) -> Iterator[Row]:
    c = d.get("compact") or (d.get("result") or {}).get("compact")
    if not c or not c.get("plain_tok_s"):
        return
    plain = c["plain_tok_s"]
    yield "plain prefill (the baseline)", plain, "tok/s", None
    for name, cap in (c.get("capture") or {}).items():
        if cap.get("tok_s"):
            yield f"{name}: capture", cap["tok_s"], "tok/s", _ratio(cap["tok_s"], plain)
    for name, r in (c.get("rows") or {}).items():
        if r.get("build_shm_tok_s"):
            yield f"{name}: build into /dev/shm", r["build_shm_tok_s"], "tok/s", _ratio(r["build_shm_tok_s"], plain)
        if r.get("bytes_per_token") and r.get("vs_bf16_bytes") is not None:
            yield f"{name}: bytes per token (vs bf16)", r["bytes_per_token"], "B/token", r["vs_bf16_bytes"]


def long_context(d: dict[str, Any]) -> Iterator[Row]:
    for size, s in (d.get("sizes") or {}).items():
        plain = s.get("plain_tok_s")
        if not plain:
            continue
        yield f"{int(size):,} tokens: plain prefill (the baseline)", plain, "tok/s", None
        if s.get("capture_tok_s"):
            yield f"{int(size):,} tokens: capture + transport", s["capture_tok_s"], "tok/s", _ratio(s["capture_tok_s"], plain)
        if s.get("build_tok_s"):
            yield f"{int(size):,} tokens: the CLI build", s["build_tok_s"], "tok/s", _ratio(s["build_tok_s"], plain)


def reads(d: dict[str, Any]) -> Iterator[Row]:
    runs = d.get("runs") or {}
    raw = runs.get("raw")
    if raw:
        yield "plain readinto (the baseline), best", max(raw) / 1e6, "MB/s", None
    for name, ratio in (d.get("ratios") or {}).items():
        yield name, ratio, "x readinto", ratio


def tokenize(d: dict[str, Any]) -> Iterator[Row]:
    best, base = d.get("best") or {}, d.get("baseline")
    base_rate = best.get(base, {}).get("tok_per_s") if base else None
    for name, r in best.items():
        yield (name if name != base else "serial, before the workers (the baseline)"), r["tok_per_s"], "tok/s", (
            None if name == base else _ratio(r["tok_per_s"], base_rate))


def startup(d: dict[str, Any]) -> Iterator[Row]:
    best = d.get("best_s") or {}
    torch = best.get("python -c 'import torch'")
    for name, s in best.items():
        yield name, s, "s", None if name == "python -c 'import torch'" else _ratio(s, torch)


def stream(d: dict[str, Any]) -> Iterator[Row]:
    t = d.get("tok_s") or {}
    names = {"plain": "the build alone (the baseline)", "alone": "with --stream, nobody reading",
             "trainer": "with --stream and a trainer reading"}
    for key, name in names.items():
        if t.get(key):
            yield name, t[key], "tok/s", None if key == "plain" else _ratio(t[key], t.get("plain"))


def verified_reads(d: dict[str, Any]) -> Iterator[Row]:
    runs = [d] if "first_epoch_local" in d else [r for r in (d.get("cold"), d.get("hot")) if r]
    for r in runs:
        cache = "hot" if (r.get("setup") or {}).get("page_cache") == "hot" else "cold"
        gb = (r.get("setup") or {}).get("payload_gb")
        what = f"{cache} page cache, {gb} GB" if gb else f"{cache} page cache"
        for key, name in (("first_epoch_local", "first epoch"), ("streaming_local_test_hub", "streamed from the local Hub")):
            g = (r.get(key) or {}).get("GB/s") or {}
            if g.get("unchecked") and g.get("checked"):
                yield f"{what}: {name}, unchecked (the baseline), median", g["unchecked"]["median"], "GB/s", None
                yield f"{what}: {name}, every block checked (pairs' mean ratio)", g["checked"]["median"], "GB/s", \
                    r[key].get("ratio_checked_to_unchecked")


def many_nodes(d: dict[str, Any]) -> Iterator[Row]:
    f, rps = d.get("figures") or {}, d.get("rows_per_s") or {}
    if f.get("fetched_over_version") is not None:
        yield "bytes fetched per epoch, all nodes (vs the version's size)", d["fetched_bytes_all_nodes"], "B", \
            f["fetched_over_version"]
    peak = max(d.get("peak_cache_bytes_per_node") or [0])
    if peak and f.get("peak_cache_over_bound") is not None:
        yield "peak cache of a node (vs its bound)", peak, "B", f["peak_cache_over_bound"]
    base = rps.get("open_dataset_local_copy")
    if base:
        yield "open_dataset of a local copy (the baseline)", base, "rows/s", None
        for key, name in (("open_ranked_cached", "open_ranked, shards in its cache"),
                          ("open_ranked_fetching_bounded_cache", "open_ranked, fetching into a bounded cache")):
            if rps.get(key):
                yield name, rps[key], "rows/s", _ratio(rps[key], base)


def source_reads(d: dict[str, Any]) -> Iterator[Row]:
    for kind in ("jsonl", "parquet"):
        k = d.get(kind) or {}
        if k.get("one_pass_cpu_s"):
            yield f"{kind}, {k['rows']:,} rows: one pass (the baseline), CPU", k["one_pass_cpu_s"], "s", None
            yield f"{kind}: {k['parts']:,} parts in one call, CPU", k["parts_one_cpu_s"], "s", k.get("ratio_parts_one_cpu")
            yield f"{kind}: {k['parts']:,} parts, one call each, CPU", k["parts_each_cpu_s"], "s", \
                k.get("ratio_parts_each_cpu")


def writer_path(d: dict[str, Any]) -> Iterator[Row]:
    for variant, r in ((d.get("final") or {}).get("ratios") or {}).items():
        if r.get("wall") is not None:
            yield f"{variant}: build wall time, this writer vs the one before", r["wall"], "x", r["wall"]
            yield f"{variant}: CPU per GB, this writer vs the one before", r["cpu_per_GB"], "x", r["cpu_per_GB"]


def derived_uploads(d: dict[str, Any]) -> Iterator[Row]:
    for key, name in (("half", "a 50% subset of one version"), ("mix", "a 3-way mix")):
        r = d.get(key) or {}
        if r.get("upload_bytes"):
            yield f"{name}: bytes a push uploads (vs its sources)", r["upload_bytes"], "B", r["upload_share_of_source"]
            if r.get("xet_new_bytes"):
                yield f"{name}: new bytes by the Xet client (vs its sources)", r["xet_new_bytes"], "B", \
                    r["xet_share_of_source"]


def scaleout(d: dict[str, Any]) -> Iterator[Row]:
    results = d.get("results") or {}
    for name, r in results.items():
        yield name, r["samples_per_s"], "samples/s", None if r.get("ratio") == 1.0 else r.get("ratio")


def reversions(d: dict[str, Any]) -> Iterator[Row]:
    for coding, r in (d.get("results") or {}).items():
        shared = ((r.get("v2") or {}).get("data") or {}).get("by_bytes")
        if shared is not None:
            yield f"{coding}: v2 (1% of samples edited), shard bytes shared with v1", shared, "share", shared


def file_writes(d: dict[str, Any]) -> Iterator[Row]:
    methods = d.get("methods") or {}
    base = (methods.get("write") or {}).get("GBps")
    names = {"write": "one thread, one file (the baseline)", "pwrite": "threads writing pieces of one file",
             "mmap": "threads copying into one mapped file", "files": "files written side by side"}
    for key, m in methods.items():
        kind, _, n = key.partition("-")
        name = names.get(kind, kind) + (f", {n}" if n else "")
        yield name, m["GBps"], "GB/s", None if key == "write" else _ratio(m["GBps"], base)


def fp8_decode(d: dict[str, Any]) -> Iterator[Row]:
    runs = d.get("runs") if isinstance(d.get("runs"), dict) else {"": d}
    for key, r in runs.items():
        state = r.get("state") if isinstance(r, dict) else None
        if not state or "cast_gb_s" not in state:
            continue
        where = f"{r.get('threads', '?')} threads, {r.get('busy', 0)} busy" + (
            f", blocks of {r['block']:,}" if r.get("block") else "")
        yield f"{where}: the cast (the baseline)", state["cast_gb_s"], "GB/s", None
        yield f"{where}: the table", state["bits_gb_s"], "GB/s", _ratio(state["bits_gb_s"], state["cast_gb_s"])


def fp8_reads(d: dict[str, Any]) -> Iterator[Row]:
    ways = ((d.get("result") or {}).get("ways")) or {}
    base = (ways.get("decode") or {}).get("tok_s_median")
    names = {"decode": "decoded on the host (the baseline)", "codes": "fp8 codes, fp8='codes'",
             "codes+decode": "codes, then decode_on(batch, 'cpu')"}
    for key, w in ways.items():
        if w.get("tok_s_median"):
            yield names.get(key, key), w["tok_s_median"], "tok/s", None if key == "decode" else _ratio(
                w["tok_s_median"], base)


TABLES = [
    Table("Capture and build at Kimi-K2.5's width",
          "The SGLang engine with the capture plugin against the same engine's plain prefill of the same token ids, "
          "on a 6-layer model of Kimi-K2.5's width (DeepSeek-V3 architecture, hidden 7168, random weights; 3 layers + "
          "the final state, 57,344 bytes per token), 128 samples of 2,048 tokens. A build onto the disk is compared "
          "with what the disk allows (its measured write rate over the bytes per token).",
          "*-kimi-width*.json", "python benchmarks/sglang_extraction.py --shape kimi --samples 128", kimi_width),
    Table("Compact versions",
          "Each storage option of [Compact versions](building/compact.md) on the Kimi-width model: the capture alone, "
          "a whole build into /dev/shm (so that no disk decides), against plain prefill in the same run; and the bytes "
          "per token against bf16.",
          "*-compact*.json", "python benchmarks/compact.py --builds 2", compact),
    Table("Long context",
          "Samples of 8k, 32k and 131k tokens on the Kimi-width model with YaRN: capture + transport and the CLI "
          "build attached to one server, against plain prefill of the same lengths.",
          "*-long-context*.json", "python benchmarks/long_context.py --sizes 8192x64,32768x1,131072x1", long_context),
    Table("Reads into training batches",
          "Kimi-shaped samples (2.82 GB, 3 shards) read cold into `DrafterCollator` batches, each reader's run paired "
          "with a plain `readinto` of the same files (the geometric mean or median of the pairs' ratios).",
          "*-reads*.json", "python benchmarks/reads.py", reads),
    Table("Writing shard files",
          "One process writing Kimi-width rows (117 MB each, taken in turn from a shared mapping as a build's come "
          "from the ring) into /dev/shm, by method, against one thread writing one file.",
          "*-file-writes*.json", "python benchmarks/file_writes.py --dir /dev/shm --threads 2,4,8", file_writes),
    Table("fp8 decode on the CPU",
          "A Kimi-width fp8 state (2,048 x 7,168) decoded to bf16 by the table of the 256 codes' values, against "
          "PyTorch's cast, alone and beside processes keeping a core busy each.",
          "*-fp8-decode*.json", "python benchmarks/fp8_decode.py", fp8_decode),
    Table("fp8 reads into training batches",
          "An fp8 build read into `DrafterCollator` batches: the stored codes (half the bytes of bf16), and the codes "
          "decoded after the collation, against batches decoded on the host.",
          "*-fp8-reads*.json", "python benchmarks/fp8_reads.py --reps 4", fp8_reads),
    Table("Tokenizing",
          "The tokenize stage (parse, chat template, tokenizer, loss mask) on 2,000 conversations with the "
          "Kimi-packaged tokenizer, serial and in worker processes, against the serial path before the workers.",
          "*-tokenize.json", "python benchmarks/tokenize_rate.py --rows 2000 --reps 3 --workers 2", tokenize),
    Table("Command start-up",
          "The time to answer `--version`, a typo, `--help` and a configuration error, against importing torch "
          "(none of these imports it).",
          "*-startup.json", "python benchmarks/startup.py", startup),
    Table("Train while it builds",
          "A build with `--stream` and a trainer process reading every row into `DrafterCollator` batches, against "
          "the same build alone.",
          "*-stream*.json", "python benchmarks/stream.py", stream),
    Table("Verified reads",
          "The first epoch of `open_dataset` + `iter_torch` + `DrafterCollator` over Kimi-shaped rows with every 1 MiB "
          "block hashed as it is read, against the same epoch unchecked, in pairs of fresh processes; and the same "
          "version streamed from the local test Hub (the ratio: the pairs' geometric mean).",
          "*-verified-reads*.json", "python benchmarks/verified_reads.py --gb 2 --reps 6", verified_reads),
    Table("Training on many nodes",
          "Two nodes of two ranks each reading one epoch of a version in a local S3-compatible store through "
          "`open_ranked`, each node's cache bounded at a quarter of the version; the reader against `open_dataset` "
          "of a local copy.", "*-many-nodes*.json", "python benchmarks/many_nodes.py", many_nodes),
    Table("Reading a source in parts",
          "A 1M-row source read in parts of 256 rows (one call over all parts, and one call per part) against one "
          "pass over it.", "*-source-reads*.json", "python benchmarks/source_reads.py", source_reads),
    Table("The shard writer",
          "The CPU demo build through the shard writer against the writer it replaced, in one run, the trees "
          "alternating.", "*-build-cpu-writer-path*.json", "python benchmarks/build_cpu.py --trees OLD,NEW", writer_path),
    Table("Derived versions on the Hub",
          "What a push of a derived version uploads, by the Hub's content-defined chunks, against its sources' bytes.",
          "*-derived-uploads*.json", "python benchmarks/derived_uploads.py", derived_uploads),
    Table("Workers on one machine",
          "The tiny demo model, 512 rows, built by one worker, two torchrun-style workers and two Ray workers on a "
          "new local cluster, start-up and merge included, against one worker.",
          "*-scaleout.json", "python benchmarks/scaleout.py --ray", scaleout),
    Table("Re-versions",
          "How much of a second version's shard bytes the Hub's content-defined chunks share with the first, when 1% "
          "of the samples changed (the share is its own ratio).",
          "*-reversions.json", "python benchmarks/reversions.py", reversions),
]


def machine(name: str) -> str:
    if "-h200-" in name or "-h100-" in name:
        return "H200 host" if "-h200-" in name else "H100 host"
    return "2-core CPU VM" if re.search(r"-(cpu-)?vm-", name) else "?"


def command(d: dict[str, Any], default: str) -> str:
    c = d.get("command") or d.get("command_cold") or default
    c = re.sub(r"\s+\([A-Za-z].*$", "", str(c)).replace("python3 ", "python ")  # the command, not its notes
    return re.sub(r"\s--json\s+\S+", "", re.sub(r"^timeout \d+ ", "", c))  # where a run put its JSON, its time limit


def number(x: float, unit: str) -> str:
    if unit in ("share", "x readinto"):
        return f"{x:.3f}"
    if unit == "s":
        return f"{x:.2f} s"
    return f"{x:,.0f} {unit}" if x >= 100 else f"{x:.2f} {unit}"


def page() -> str:
    out = ["# Benchmarks", "",
           "Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; do not edit by hand. Each "
           "row is one figure of one run with its ratio to the baseline measured in the same run (the row marked "
           "\"baseline\"). Speed and memory targets live here as ratios, never as timed assertions in the tests.", ""]
    for t in TABLES:
        rows = []
        for f in sorted(RESULTS.glob(t.files)):
            d = json.loads(f.read_text(encoding="utf-8"))
            date = f.name[:10]
            for figure, value, unit, ratio in t.rows(d):
                r = "baseline" if ratio is None else f"{ratio:.3f}x"
                rows.append(f"| {date} | {machine(f.name)} | `{command(d, t.command)}` | {figure}: {number(value, unit)} "
                            f"| {r} |")
        if not rows:
            continue
        out += [f"## {t.title}", "", t.about, "", "| date | machine | command | figure | ratio |", "|---|---|---|---|---|",
                *rows, ""]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/benchmarks.md is stale")
    a = ap.parse_args()
    text = page()
    if a.check:
        if PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE} is stale: run python benchmarks/report.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
