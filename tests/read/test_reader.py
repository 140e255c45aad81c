"""Reading for training: in-place ops never crash nor reach the files, DataLoader workers, the
TORCH_FORMAT ``datasets`` format, the packed collator, the README snippet and the training example."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from torch.utils.data import DataLoader

from hs_dataset.read.collate import DrafterCollator
from hs_dataset.read.decode import decode_row
from hs_dataset.read.iterate import iter_torch
from hs_dataset.read.open import open_dataset
from hs_dataset.read.safe_views import MIN_MAP_BYTES
from hs_dataset.read.torch_format import TORCH_FORMAT
from tests.fixtures.builds import random_build

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo(tiny_model, tmp_path_factory) -> Path:
    """The demo build of the README (builder_scripts/tiny_demo.py, transformers backend) in ``.../demo_out``."""
    out = tmp_path_factory.mktemp("readme") / "demo_out"
    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "build", str(ROOT / "builder_scripts" / "tiny_demo.py"),
                        "--output", str(out), "--set", f"model={tiny_model}", "--no-progress"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def large(tmp_path_factory) -> dict[str, Path]:
    """bf16 and fp8 builds whose states (1100 x 1024) are over MIN_MAP_BYTES: handed out as private
    mappings, not copies; parts of 2 rows, so 3 shard files."""
    d = tmp_path_factory.mktemp("large")
    assert 1100 * 1024 >= MIN_MAP_BYTES
    return {dtype: random_build(d, samples=5, tokens=1100, hidden=1024, name=dtype, part_size=2, storage_dtype=dtype)
            for dtype in ("bfloat16", "fp8_e4m3")}


def _file_hashes(*dirs: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for d in dirs for p in sorted(d.rglob("*.arrow"))}


INPLACE = r'''
import sys, datasets, torch
from hs_dataset.read import TORCH_FORMAT, iter_torch, open_dataset

path, cache, mapped = sys.argv[1], sys.argv[2], sys.argv[3] == "1"

def private_map_of(t):
    """The writable private (copy-on-write) file mapping holding t's memory, from /proc/self/maps."""
    a = t.data_ptr()
    for line in open("/proc/self/maps"):
        f = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in f[0].split("-"))
        if lo <= a < hi and f[1] == "rw-p" and len(f) == 6:
            return f[5].strip()

opened = {"open_dataset": open_dataset(path), "load_dataset(dir)": datasets.load_dataset(path, split="train", cache_dir=cache),
          "streaming": datasets.load_dataset(path, split="train", streaming=True),
          "open_dataset(streaming=True)": open_dataset(path, streaming=True)}
for how, ds in opened.items():
    ref = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in r.items()} for r in iter_torch(ds)]
    reads = {"iter_torch": iter_torch(ds, batch_size=2), "iter_torch(prefetch=0)": iter_torch(ds, prefetch=0),
             "TORCH_FORMAT": iter(ds.with_format(TORCH_FORMAT))}
    for what, rows in reads.items():
        n = 0
        for row, want in zip(rows, ref):
            assert row["id"] == want["id"]
            for k, v in row.items():
                if isinstance(v, torch.Tensor):  # input_ids, loss_mask, every hidden_layer_k, hidden_final
                    v.mul_(2)
                    v.view(-1)[0] = 1
                    v.add_(1)
                    if mapped and how != "streaming" and k.startswith("hidden_"):
                        where = private_map_of(v)
                        assert where and (where.startswith(path) or where.startswith(cache)), (how, what, k, where)
            n += 1
        assert n == len(ref), (how, what, n)
    for row, want in zip(iter_torch(ds), ref):  # a new read sees the file's values, never an earlier write
        for k, v in want.items():
            assert torch.equal(row[k], v) if isinstance(v, torch.Tensor) else row[k] == v, (how, k)
    print(how, "survived", len(ref), "rows", flush=True)
'''


@pytest.mark.parametrize("which", ["demo", "bfloat16", "fp8_e4m3"])
def test_in_place_ops_on_every_column_never_crash_nor_touch_the_files(which, demo, large, tmp_path):
    path = demo if which == "demo" else large[which]
    cache = tmp_path / "hf-cache"
    datasets.load_dataset(str(path), split="train", cache_dir=str(cache))  # its Arrow copy, hashed too
    before = _file_hashes(path, cache)
    mapped = which == "bfloat16"  # fp8 states are decoded (new tensors); the demo's are copies (small)
    r = subprocess.run([sys.executable, "-c", INPLACE, str(path), str(cache), "1" if mapped else "0"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.count("survived") == 4, r.stdout
    assert _file_hashes(path, cache) == before and len(before) >= 2


def _ids_and_batch(rows: list[dict]) -> tuple[list[str], dict[str, torch.Tensor]]:
    return [r["id"] for r in rows], DrafterCollator()(rows)


def _check_batch(batch: dict[str, torch.Tensor], rows: list[dict]) -> None:
    assert batch["aux_hidden_states"].is_shared()  # made in the worker's shared memory: handed over, not copied
    for b, row in enumerate(rows):
        n = len(row["input_ids"])
        first = min((c for c in row if c.startswith("hidden_layer_")), key=lambda c: int(c.rsplit("_", 1)[1]))
        assert torch.equal(batch["hidden_states"][b, :n], row["hidden_final"])
        assert torch.equal(batch["aux_hidden_states"][b, :n, :row[first].shape[1]], row[first])
        assert torch.equal(batch["input_ids"][b, :n], row["input_ids"].long())


def test_dataloader_workers_over_open_dataset_and_streaming(large):
    path = large["bfloat16"]
    ds = open_dataset(path).with_format(TORCH_FORMAT)
    ref = list(iter_torch(ds))
    data = sum(p.stat().st_size for p in (path / "data").glob("*.arrow"))
    assert len(pickle.dumps(ds)) < min(64 << 10, data // 100)  # the workers get the shard paths, not the table
    # spawn: each worker starts bare, maps the shards itself and has TORCH_FORMAT from unpickling the collator
    loader = DataLoader(ds, batch_size=2, num_workers=2, collate_fn=DrafterCollator(), multiprocessing_context="spawn")
    batches = list(loader)
    assert len(batches) == 3
    for k, batch in enumerate(batches):
        _check_batch(batch, ref[2 * k:2 * k + 2])
    for stream in (datasets.load_dataset(str(path), split="train", streaming=True), open_dataset(path, streaming=True)):
        stream = stream.with_format(TORCH_FORMAT)
        assert stream.num_shards >= 2  # each worker gets its own shards
        by_id, seen = {r["id"]: r for r in ref}, []
        for ids, batch in DataLoader(stream, batch_size=2, num_workers=2, collate_fn=_ids_and_batch):
            _check_batch(batch, [by_id[i] for i in ids])
            seen += ids
        assert sorted(seen) == sorted(by_id)


def test_torch_format_gives_bf16_tensors_where_with_format_torch_gives_int64(demo):
    ds = open_dataset(demo)
    fmt = ds.with_format(TORCH_FORMAT)
    layers = [c for c in ds.column_names if c.startswith("hidden_layer_")]
    want = decode_row(ds.with_format("arrow")[3])
    row = fmt[3]
    assert row["id"] == want["id"] and row["num_tokens"] == len(want["input_ids"])
    for c in ["hidden_final", *layers]:
        assert row[c].dtype == torch.bfloat16 and torch.equal(row[c], want[c])
    assert row["input_ids"].dtype == torch.int32 and torch.equal(row["input_ids"], want["input_ids"])
    batch = fmt[2:5]
    assert [r["id"] for r in (decode_row(ds.with_format("arrow")[i]) for i in (2, 3, 4))] == batch["id"]
    assert all(t.dtype == torch.bfloat16 for t in batch["hidden_final"])
    assert sum(len(b["id"]) for b in fmt.iter(batch_size=16)) == len(ds)
    stream = datasets.load_dataset(str(demo), split="train", streaming=True).with_format(TORCH_FORMAT)
    first = next(iter(stream))
    assert first["hidden_final"].dtype == torch.bfloat16 and first["id"] == fmt[0]["id"]
    # the README's warning: with_format("torch") gives the stored uint16 bits as int64 numbers
    assert ds.with_format("torch")[3]["hidden_final"].dtype == torch.int64


def test_packed_collator_concatenates_what_the_padded_one_pads(demo):
    rows = list(iter_torch(open_dataset(demo)))[:3]
    pad = DrafterCollator()(rows)
    pk = DrafterCollator(packed=True)(rows)
    lens = [len(r["input_ids"]) for r in rows]
    assert pk["cu_seqlens"].tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert pk["hidden_states"].shape == (1, sum(lens), rows[0]["hidden_final"].shape[1])
    for b, n in enumerate(lens):
        s = int(pk["cu_seqlens"][b])
        for k in ("hidden_states", "aux_hidden_states", "input_ids", "loss_mask"):
            assert torch.equal(pk[k][0, s:s + n], pad[k][b, :n]), k
        assert torch.equal(pk["position_ids"][0, s:s + n], torch.arange(n))
    cut = DrafterCollator(packed=True, max_length=20)(rows)
    assert cut["cu_seqlens"].tolist() == [0, 20, 40, 60] and torch.equal(cut["hidden_states"][0, 20:40],
                                                                         rows[1]["hidden_final"][:20])


def test_readme_load_for_training_snippet_runs_verbatim_on_the_demo_build(demo):
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Load for training"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "demo_out" in code and "hidden_layer_3" not in code
    script = demo.parent / "snippet.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], cwd=demo.parent, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shapes = ast.literal_eval(r.stdout.strip().splitlines()[-1])  # the batch's shapes, as the README says
    meta = json.loads((demo / "hs_dataset.json").read_text())
    H, n = meta["model"]["hidden_size"], len(meta["layers"])
    B, T = shapes["input_ids"]
    assert B == 4 and shapes["loss_mask"] == (B, T) and shapes["hidden_states"] == (B, T, H)
    assert shapes["aux_hidden_states"] == (B, T, n * H)


def test_drafter_training_example_loss_falls(demo, tmp_path):
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}  # datasets caches a folder by its name
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_drafter.py"), str(demo), "--steps", "40"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(steps) == 40
    loss, kl = [s["loss"] for s in steps], [s["kl"] for s in steps]
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.05, loss
    assert sum(kl[-5:]) < 0.75 * sum(kl[:5]), kl  # the draft moves towards the target's distribution
