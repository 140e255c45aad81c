"""Reading long samples for training (issue 25, item 4): windows and context-parallel slices of a sample
equal the sample's positions, read only the pages of those positions; length buckets keep short and long
samples apart."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from hs_dataset.read.buckets import LengthBucketSampler, length_buckets
from hs_dataset.read.open import open_dataset
from hs_dataset.read.windows import cp_slice, iter_windows, read_window, sample_rows
from hs_dataset.write.driver import build
from tests.fixtures.ring_engine import ThreadEngine
from tests.write.test_long_rows import STATES, long_config, long_source, samples_of
from tests.fixtures.builds import wide_model_dir


@pytest.fixture(scope="module")
def long_build(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("long-rows")
    out = d / "out"
    build(long_config(tiny_model, long_source(d / "long.jsonl"), row_tokens=256), out, progress=False)
    return out


def test_windows_put_together_are_the_samples(long_build):
    whole = samples_of(long_build)
    ds = open_dataset(long_build)
    got: dict[str, dict[str, list]] = {}
    for w in iter_windows(ds, 300):  # 300: windows cross the 256-position rows
        assert w["input_ids"].shape[0] == w["hidden_final"].shape[0] <= 300
        g = got.setdefault(w["id"], {c: [] for c in ("input_ids", "loss_mask", *STATES)})
        assert w["token_start"] == sum(t.shape[0] for t in g["input_ids"])
        ids = whole[w["id"]]["input_ids"]
        end = w["token_start"] + w["input_ids"].shape[0]
        assert w["next_id"] == (int(ids[end]) if end < ids.shape[0] else -1)
        for c in g:
            g[c].append(w[c])
    assert got.keys() == whole.keys()
    for sid, g in got.items():
        for c in g:
            assert torch.equal(torch.cat(g[c]), whole[sid][c]), (sid, c)


def test_context_parallel_slices_are_disjoint_and_cover_the_sample(long_build):
    ds = open_dataset(long_build)
    s = max(sample_rows(ds), key=lambda s: s.num_tokens)
    whole = samples_of(long_build)[s.sample_id]["hidden_layer_1"]
    slices = [cp_slice(s.num_tokens, k, 3) for k in range(3)]
    assert slices[0][0] == 0 and slices[-1][1] == s.num_tokens and all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    for k, (a, b) in enumerate(slices):
        w = read_window(ds, s, a, b, columns=["hidden_layer_1"])
        assert torch.equal(w["hidden_layer_1"], whole[a:b])
        ranked = [x for x in iter_windows(ds, 10_000, columns=["hidden_layer_1"], cp_rank=k, cp_size=3)
                  if x["id"] == s.sample_id]
        assert [(x["token_start"], x["token_start"] + x["input_ids"].shape[0]) for x in ranked] == [(a, b)]


def test_a_window_reads_only_its_own_pages(tmp_path):
    """A 16,384-position sample of 4 states x 2048 (256 MiB): a 512-position window from its middle reads
    a few MiB from disk (page cache dropped for the file), not the sample."""
    model = wide_model_dir(tmp_path / "wide")
    rng = np.random.default_rng(0)
    with open(tmp_path / "src.jsonl", "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": " ".join(
            map(str, rng.integers(0, 10**6, size=3300)))}]}) + "\n")
    pool = torch.randn((4, 4096, 2048), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    eng = ThreadEngine(str(model), (0, 1, 2), lambda ids, a, b: pool[:, a % 4096:a % 4096 + b - a],
                       ring_dir=tmp_path / "ring", ring_bytes=600 << 20, chunk=4096)
    try:
        build(long_config(str(model), tmp_path / "src.jsonl", max_length=16384, row_tokens=4096), tmp_path / "out",
              backend=eng, progress=False)
    finally:
        eng.close()
    ds = open_dataset(tmp_path / "out")
    (s,) = sample_rows(ds)
    assert s.num_tokens == 16384 and len(s.starts) == 4
    read_window(ds, s, 0, 1)  # the shards' one-time hash check (hs_dataset.read.shard_checks) happens here
    for f in (tmp_path / "out" / "data").iterdir():
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    def read_bytes() -> int:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("read_bytes")).split()[1])

    before = read_bytes()
    w = read_window(ds, s, 6000, 6512)
    total = sum(float(w[c].float().sum()) for c in STATES)  # touch every value of the window
    got = read_bytes() - before
    window_bytes = 512 * 4 * 2048 * 2  # 8 MiB
    assert np.isfinite(total) and w["hidden_final"].shape == (512, 2048)
    # The kernel reads around each first touch of a mapping (read_ahead_kb: 8 MiB on the CI machine), once per
    # mapping (4 states, the ids and the mask): beyond that, nothing of the 256 MiB sample is read.
    dev = os.stat(tmp_path).st_dev
    sysfs = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    around = 8 << 20
    for q in (f"{sysfs}/queue/read_ahead_kb", f"{sysfs}/../queue/read_ahead_kb"):
        if os.path.exists(q):
            with open(q) as f:
                around = int(f.read()) * 1024
            break
    assert got <= window_bytes + 6 * 2 * around and got < (256 << 20) / 2, \
        f"read {got / 2**20:.1f} MiB for an 8 MiB window of a 256 MiB sample"
    assert torch.equal(w["hidden_final"], pool[3, 6000 % 4096:6000 % 4096 + 512])


def test_length_buckets_batch_similar_lengths_within_the_budget():
    rng = np.random.default_rng(0)
    lengths = list(rng.integers(50, 400, size=300)) + list(rng.integers(20000, 120000, size=20))
    batches = length_buckets(lengths, 65536, seed=1)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        longest = max(lengths[i] for i in b)
        assert len(b) == 1 or longest * len(b) <= 65536
        assert not (min(lengths[i] for i in b) < 1000 < longest)  # never short and long together
    assert batches == length_buckets(lengths, 65536, seed=1)
    sampler = LengthBucketSampler(lengths, 65536, seed=1)
    first = list(sampler)
    sampler.set_epoch(1)
    assert first == batches and list(sampler) != first and len(sampler) == len(list(sampler))
