#!/usr/bin/env python
"""Read benchmark (issue 28): do the training read paths move at the disk's speed, and what disk do they take?

    python benchmarks/reads.py                 # Kimi shapes (H=7168, 3 aux layers + final, 2048 tokens), 24 samples
    python benchmarks/reads.py --samples 48    # 5.6 GB
    python benchmarks/reads.py --quick         # tiny shapes, seconds (the smoke test)

READ: every reader turns the build into the same ``DrafterCollator`` training batches (bf16, ``[B, T, ...]``),
and every figure is a ratio to a plain ``readinto`` of the same shard files into a preallocated tensor: one
copy from the page cache into memory that is already there, the least any reader can do. Each reader's run
is paired with a baseline run next to it, and the ratio is the geometric mean of the pairs' speed ratios:
the disk of a shared VM drifts by 2-5x within minutes, a pair sees the same disk. The order within a pair
alternates and the number of pairs is even (``--reps`` is rounded up), so each order counts as often: the
disk of this VM bursts and then throttles, which favours whichever run of a pair comes first, and a median
of an odd number of pairs took that bias from the majority order (the median and the spread are printed
too). ``--cache cold`` (default): the files' page cache is dropped before every run
(``posix_fadvise(DONTNEED)`` after ``fsync``, or ``--drop sys``: ``echo 1 > /proc/sys/vm/drop_caches``,
root), and the share still resident is measured (``mincore``) and printed; ``--cache hot``: the files are
read into the page cache before every run (what the readers cost in CPU). Steady state: each reader's
batch buffers exist before its timed runs (one collator per reader, the DataLoaders' workers persistent),
as the baseline's buffer does, and the shards are verified (their content hash checked once this boot, as
on every later epoch); the first read, with the hash checks, is a reader of its own.

DISK: what each way of opening a build for training leaves on disk, for a local build and for a version
published to the local test Hub (``tests/fakehub``, the real ``huggingface_hub`` client over HTTP), as a
ratio to the version's bytes: ``open_dataset(dir)``, ``open_dataset("org/name", revision=...)``,
``load_dataset(dir)`` and ``load_dataset("org/name", revision=...)``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from storage import (PrecomputedBackend, Runs, Shape, consume, drop_cache, make_model_dir, make_source,  # noqa: E402
                     make_states, plain_read)

TARGETS = {"open_iter": 0.90, "stream_iter": 0.80, "loader2": 0.80}  # issue 28's acceptance, vs a plain readinto


# ---------------------------------------------------------------------------------------------
# Page cache
# ---------------------------------------------------------------------------------------------


def resident(files: Iterable[Path]) -> float:
    """The share of the files' pages in the page cache (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    import numpy as np

    pages = held = 0
    for p in files:
        size = p.stat().st_size
        if not size:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * n)()
            libc.mincore(addr, size, vec)
            libc.munmap(addr, size)
        finally:
            os.close(fd)
        pages += n
        held += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
    return held / max(pages, 1)


def dropper(how: str) -> Callable[[list[Path]], None]:
    if how == "sys":
        def drop(files: list[Path]) -> None:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return drop
    return drop_cache


# ---------------------------------------------------------------------------------------------
# Readers: each returns the payload bytes it put into DrafterCollator batches
# ---------------------------------------------------------------------------------------------


def batches(rows: Iterable[dict], collator, batch: int) -> int:
    total, buf = 0, []
    for r in rows:
        buf.append(r)
        if len(buf) == batch:
            total += consume(collator(buf))
            buf = []
    if buf:
        total += consume(collator(buf))
    return total


class Readers:
    def __init__(self, a: argparse.Namespace, out: Path, shape: Shape):
        from hs_dataset.read import DrafterCollator

        self.a, self.out, self.shape = a, out, shape
        self.files = sorted((out / "data").glob("train-*"))
        self.collators: dict[str, Any] = {}
        self.loaders: dict[str, Any] = {}
        import torch

        self.buffer = torch.zeros(a.batch * shape.sample_bytes // 2, dtype=torch.bfloat16)  # the baseline's tensor
        self.make_collator = DrafterCollator
        self.specforge_files: list[Path] = []

    def coll(self, key: str):
        return self.collators.setdefault(key, self.make_collator())

    def raw(self) -> int:
        """A plain readinto of the shard files, one batch of states at a time, into one preallocated tensor."""
        plain_read(self.files, self.buffer)
        return self.shape.payload  # the states those bytes hold: every reader's figure is states per second

    def open_iter(self) -> int:
        from hs_dataset.read import iter_torch, open_dataset

        return batches(iter_torch(open_dataset(self.out), batch_size=self.a.batch), self.coll("open_iter"), self.a.batch)

    def stream_iter(self) -> int:
        from hs_dataset.read import iter_torch, open_dataset

        ds = open_dataset(self.out, streaming=True)
        return batches(iter_torch(ds, batch_size=self.a.batch), self.coll("stream_iter"), self.a.batch)

    def stream_format(self) -> int:
        from hs_dataset.read import TORCH_FORMAT, open_dataset

        return batches(iter(open_dataset(self.out, streaming=True).with_format(TORCH_FORMAT)), self.coll("stream_format"),
                       self.a.batch)

    def getitem(self) -> int:
        from hs_dataset.read import TORCH_FORMAT, open_dataset

        ds = open_dataset(self.out).with_format(TORCH_FORMAT)
        return batches((ds[i] for i in range(len(ds))), self.coll("getitem"), self.a.batch)

    def loader(self, workers: int, streaming: bool = False) -> Callable[[], int]:
        def run() -> int:
            from torch.utils.data import DataLoader

            from hs_dataset.read import TORCH_FORMAT, open_dataset

            key = f"{workers}{streaming}"
            if key not in self.loaders:
                ds = open_dataset(self.out, streaming=True) if streaming else open_dataset(self.out)
                self.loaders[key] = DataLoader(ds.with_format(TORCH_FORMAT), batch_size=self.a.batch, num_workers=workers,
                                               collate_fn=self.make_collator(), persistent_workers=workers > 0)
            return sum(consume(b) for b in self.loaders[key])
        return run

    def plain_stream_iter(self) -> int:
        import datasets

        from hs_dataset.read import iter_torch

        ds = datasets.load_dataset(str(self.out), split="train", streaming=True)
        return batches(iter_torch(ds, batch_size=self.a.batch), self.coll("plain_stream_iter"), self.a.batch)

    def plain_stream_format(self) -> int:
        import datasets

        from hs_dataset.read import TORCH_FORMAT

        ds = datasets.load_dataset(str(self.out), split="train", streaming=True).with_format(TORCH_FORMAT)
        return batches(iter(ds), self.coll("plain_stream_format"), self.a.batch)

    def hf_torch(self) -> int:
        """``load_dataset(dir).with_format("torch")`` rows (int64 copies of the bits) -> bf16 -> DrafterCollator,
        the first ``--torch-format-samples`` rows (it is slow); the cache copy made before, untimed."""
        import datasets
        import torch

        ds = datasets.load_dataset(str(self.out), split="train").with_format("torch")
        limit = min(self.a.torch_format_samples, len(ds))

        def rows():
            for k in range(limit):
                r = ds[k]
                yield {c: (v.to(torch.int16).view(torch.bfloat16) if c.startswith("hidden_") else v)
                       for c, v in r.items() if isinstance(v, torch.Tensor)}
        batches(rows(), self.coll("hf_torch"), self.a.batch)
        return limit * self.shape.sample_bytes

    def specforge(self) -> int:
        """SpecForge's offline path over ``hs-dataset export --to specforge`` files: ``OfflineEagle3Dataset``
        (``torch.load(mmap=True)``, squeeze, ``[None]``) + ``DataCollatorWithPadding`` (``torch.cat``)."""
        import torch

        def pad3(t, n):
            return torch.cat((t, torch.zeros(t.shape[0], n - t.shape[1], t.shape[2], dtype=t.dtype)), dim=1)

        total, buf = 0, []
        for p in self.specforge_files:
            d = torch.load(p, mmap=True, weights_only=True)
            buf.append({"hidden_state": d["aux_hidden_state"].squeeze(0)[None], "target": d["hidden_state"].squeeze(0)[None]})
            if len(buf) == self.a.batch or p == self.specforge_files[-1]:
                n = max(x["hidden_state"].shape[1] for x in buf)
                hidden = torch.cat([pad3(x["hidden_state"], n) for x in buf])
                target = torch.cat([pad3(x["target"], n) for x in buf])
                total += (hidden.numel() + target.numel()) * 2
                buf = []
        return total

    def close(self) -> None:
        self.loaders.clear()


def timed(fn: Callable[[], int]) -> tuple[int, float]:
    t = time.perf_counter()
    n = fn()
    return n, time.perf_counter() - t


# ---------------------------------------------------------------------------------------------
# Disk: what each way of opening a build leaves on disk
# ---------------------------------------------------------------------------------------------


def disk_bytes(*roots: Path) -> int:
    """Blocks allocated under ``roots``, each file once, symlinks not followed."""
    seen, total = set(), 0
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for f in names:
                st = os.lstat(os.path.join(dirpath, f))
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += st.st_blocks * 512
    return total


def disk_costs(build: Path, work: Path) -> dict[str, Any]:
    """Each way of opening ``build`` for training, published as a version to the local test Hub; bytes left on disk."""
    import datasets

    from hs_dataset.hub.publish import push_dataset
    from hs_dataset.read import open_dataset
    from tests.fakehub.fixtures import DEFAULT_TOKEN
    from tests.fakehub.server import running_hub
    from tests.fakehub.tools import hub_client_env

    version = sum(p.stat().st_size for p in (build / "data").iterdir()) + sum(
        (build / n).stat().st_size for n in ("hs_dataset.json", "README.md", "rejects.jsonl"))
    out: dict[str, Any] = {"version_bytes": version}
    shutil.rmtree(work, ignore_errors=True)
    with running_hub(work) as hub, hub_client_env(hub, work / "home", token=DEFAULT_TOKEN):
        push_dataset(build, "org/kimi-eagle3-hs", "v1.0")
        home = work / "home"  # every cache of the client (hub, datasets, hs_dataset's versions) is under it
        ways: dict[str, Callable[[], Any]] = {
            "open_dataset(dir)": lambda: open_dataset(build),
            "open_dataset('org/name', revision='v1.0')": lambda: open_dataset("org/kimi-eagle3-hs", revision="v1.0"),
            "the same, opened again": lambda: open_dataset("org/kimi-eagle3-hs", revision="v1.0"),
            "load_dataset(dir)": lambda: datasets.load_dataset(str(build), split="train"),
            "load_dataset('org/name', revision='v1.0')": lambda: datasets.load_dataset(
                "org/kimi-eagle3-hs", revision="v1.0", split="train"),
        }
        for name, fn in ways.items():
            before, gets = disk_bytes(home), len(hub.request_log)
            t = time.perf_counter()
            fn()
            out[name] = {"bytes": disk_bytes(home) - before, "seconds": time.perf_counter() - t,
                         "data_downloads": sum(1 for m, p, s in hub.request_log[gets:]
                                               if m == "GET" and "/resolve/" in p and "/data/" in p)}
    shutil.rmtree(work, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def build_kimi(work: Path, shape: Shape, shard_mb: int, name: str = "arrow") -> Path:
    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.write.driver import build

    out = work / name
    if (out / "hs_dataset.json").is_file():
        return out
    model = make_model_dir(work / "model", shape.hidden)
    source = make_source(work / f"source-{shape.samples}.jsonl", shape.samples, shape.tokens)
    build(HiddenStatesConfig(model=str(model), layers=shape.layers(), source=str(source), max_length=shape.tokens,
                             backend="precomputed", max_shard_bytes=shard_mb << 20),
          out, backend=PrecomputedBackend(model, shape.layers(), make_states(shape)), progress=False)
    drop_cache(sorted((out / "data").glob("train-*")))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--aux-layers", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=24, help="samples of the read build (117 MB each at Kimi shapes)")
    ap.add_argument("--disk-samples", type=int, default=4, help="samples of the build published for DISK")
    ap.add_argument("--reps", type=int, default=6, help="paired runs of each reader (rounded up to an even number)")
    ap.add_argument("--batch", type=int, default=2, help="samples per training batch (DrafterCollator)")
    ap.add_argument("--shard-mb", type=int, default=1024, help="largest shard file (MiB): shards for the workers")
    ap.add_argument("--drop", choices=("fadvise", "sys"), default="fadvise", help="how the page cache is dropped")
    ap.add_argument("--cache", choices=("cold", "hot"), default="cold",
                    help="cold: the files' page cache dropped before every run; hot: read into it before every run")
    ap.add_argument("--only", default=None, help="comma-separated reader keys to run (default: all)")
    ap.add_argument("--no-disk", action="store_true", help="skip the DISK section")
    ap.add_argument("--no-compare", action="store_true",
                    help="skip load_dataset(dir).with_format('torch') and SpecForge's files (they take 2 more copies)")
    ap.add_argument("--torch-format-samples", type=int, default=6, help="rows read through with_format('torch')")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument("--dir", default=None, help="work directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    if a.quick:
        a.hidden, a.tokens, a.samples, a.disk_samples, a.reps, a.shard_mb = 256, 128, 8, 4, 1, 1
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="hs-reads-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["HF_DATASETS_CACHE"] = str(work / "hf-cache")
    os.environ["XDG_CACHE_HOME"] = str(work / "xdg")  # the shard verdicts of this run (hash checks)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return run(a, work)
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


def run(a: argparse.Namespace, work: Path) -> int:
    import datasets
    import torch

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    shape = Shape(a.hidden, a.aux_layers, a.tokens, a.samples)
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    disk = subprocess.run(["df", "-hT", str(work)], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    load = os.getloadavg()
    say(f"hs_dataset read benchmark  ({time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {os.cpu_count()} CPUs, "
        f"load average {load[0]:.1f}, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, "
        f"torch {torch.__version__}, datasets {datasets.__version__})")
    say(f"disk:   {disk}")
    out = build_kimi(work, shape, a.shard_mb)
    r = Readers(a, out, shape)
    data = sum(p.stat().st_size for p in r.files)
    say(f"data:   {shape.samples} samples x {shape.sample_bytes / 1e6:.1f} MB (H={shape.hidden}, {shape.n_states} states, "
        f"{shape.tokens} tokens) = {shape.payload / 1e9:.2f} GB of states in {len(r.files)} shards "
        f"({data / 1e9:.2f} GB); batches of {a.batch}; "
        f"{'page cache dropped by ' + a.drop if a.cache == 'cold' else 'files in the page cache (hot)'}; "
        f"{a.reps} paired repetitions")
    drop = dropper(a.drop)
    results: dict[str, Any] = {"shape": vars(shape), "disk": disk, "load_average": load, "args": vars(a)}

    readers: dict[str, tuple[str, Callable[[], int]]] = {
        "raw": ("plain readinto into a preallocated tensor (the baseline)", r.raw),
        "open_iter": ("open_dataset + iter_torch", r.open_iter),
        "stream_iter": ("open_dataset(streaming=True) + iter_torch", r.stream_iter),
        "stream_format": ("open_dataset(streaming=True) in TORCH_FORMAT", r.stream_format),
        "getitem": ("open_dataset in TORCH_FORMAT, ds[i]", r.getitem),
        "loader0": ("DataLoader, 0 workers (open_dataset, TORCH_FORMAT)", r.loader(0)),
        "loader1": ("DataLoader, 1 worker (open_dataset, TORCH_FORMAT)", r.loader(1)),
        "loader2": ("DataLoader, 2 workers (open_dataset, TORCH_FORMAT)", r.loader(2)),
        "sloader2": ("DataLoader, 2 workers (open_dataset(streaming=True), TORCH_FORMAT)", r.loader(2, streaming=True)),
        "plain_stream_iter": ("load_dataset(dir, streaming=True) + iter_torch", r.plain_stream_iter),
        "plain_stream_format": ("load_dataset(dir, streaming=True) in TORCH_FORMAT", r.plain_stream_format),
    }
    if not a.no_compare:
        from hs_dataset.interop import export_specforge

        datasets.load_dataset(str(out), split="train")  # its copy in the datasets cache, made once, untimed
        sf = work / "specforge"
        if not sf.is_dir():
            export_specforge(out, sf)
        r.specforge_files = sorted(sf.rglob("*.ckpt"))
        readers["hf_torch"] = (f"load_dataset(dir).with_format('torch'), {min(a.torch_format_samples, a.samples)} rows",
                               r.hf_torch)
        readers["specforge"] = ("SpecForge's files: torch.load(mmap=True) + its padding collator", r.specforge)

    def first_read() -> int:
        """open_dataset + iter_torch: every block hashed as it is read (as in every epoch: no verdict is kept)."""
        return r.open_iter()

    readers["first"] = ("the first read of a build: open_dataset + iter_torch + each block's hash", first_read)
    if a.only:
        keep = {"raw", *a.only.split(",")}
        readers = {k: v for k, v in readers.items() if k in keep}
    runs = {k: Runs() for k in readers}
    paired: dict[str, list[float]] = {k: [] for k in readers if k != "raw"}
    left: dict[str, float] = {}
    cache_files = sorted((work / "hf-cache").rglob("*.arrow")) + r.specforge_files
    everything = r.files + cache_files

    def one(key: str) -> float:
        if a.cache == "hot":
            plain_read(everything, r.buffer)
        else:
            drop(everything)
        share = resident(everything)
        left[key] = max(left.get(key, 0.0), share) if a.cache == "cold" else share
        n, dt = timed(readers[key][1])
        runs[key].add(n, dt)
        return n / dt

    for key in readers:  # warm-up, untimed: buffers allocated, workers started, every verdict kept
        readers[key][1]()
    reps = a.reps + a.reps % 2  # an even number: each order within a pair counts as often
    for rep in range(reps):  # each reader next to a baseline run (order alternating): the disk drifts between
        for key in (list(paired) if rep % 2 == 0 else list(paired)[::-1]):
            if rep % 2 == 0:
                raw = one("raw")
                speed = one(key)
            else:
                speed = one(key)
                raw = one("raw")
            paired[key].append(speed / raw)
    r.close()

    base = runs["raw"]
    say()
    say(f"READ into DrafterCollator batches, {a.cache} page cache  (MB/s of states: best [median]; ratio: the geometric "
        f"mean of {reps} paired runs, each reader's speed vs a plain readinto run next to it, half of them read first "
        "[the median; the lowest, the highest]; "
        f"resident: the {'largest' if a.cache == 'cold' else 'last'} share of the files in the page cache when a run "
        "started)")
    say(f"  {readers['raw'][0]:66s} {base.best / 1e6:6.0f} [{base.median / 1e6:5.0f}]  1.00x")
    for key in paired:
        ratio, lo, hi = statistics.geometric_mean(paired[key]), min(paired[key]), max(paired[key])
        med = statistics.median(paired[key])
        target = TARGETS.get(key)
        mark = f"   target >= {target:.2f}x: {'PASS' if ratio >= target else 'FAIL'}" if target else ""
        say(f"  {readers[key][0]:66s} {runs[key].best / 1e6:6.0f} [{runs[key].median / 1e6:5.0f}] {ratio:5.2f}x "
            f"[{med:.2f}; {lo:.2f}, {hi:.2f}]  resident {left[key]:.1%}{mark}")
    results["runs"] = {k: v.values for k, v in runs.items()}
    results["paired_ratios"] = {readers[k][0]: v for k, v in paired.items()}
    results["ratios"] = {readers[k][0]: statistics.geometric_mean(v) for k, v in paired.items()}
    results["ratio_statistic"] = f"geometric mean of {reps} pairs, half of them with the reader first"
    results["resident"] = left

    if not a.no_disk:
        small = build_kimi(work, Shape(a.hidden, a.aux_layers, a.tokens, a.disk_samples), a.shard_mb, "disk-build")
        costs = disk_costs(small, work / "disk")
        say()
        say(f"DISK  left by each way of opening a version of {costs['version_bytes'] / 1e6:.0f} MB for training "
            "(local test Hub, huggingface_hub over HTTP), as a share of the version")
        for name, c in costs.items():
            if isinstance(c, dict):
                say(f"  {name:50s} {c['bytes'] / 1e6:8.1f} MB  {c['bytes'] / costs['version_bytes']:6.3f}x   "
                    f"{c['data_downloads']} shard downloads, {c['seconds']:.1f}s")
        results["disk_costs"] = costs
    results["report"] = lines
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
