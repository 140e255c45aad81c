"""Smoke tests: benchmarks/storage.py and benchmarks/reads.py run end to end at a tiny size and report every figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.fixtures.builds import random_build

ROOT = Path(__file__).resolve().parents[2]


def test_storage_benchmark_quick(tmp_path):
    out = tmp_path / "results.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "storage.py"), "--quick", "--dir",
                        str(tmp_path / "work"), "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = p.stdout
    for section in ("WRITE", "SIZE", "PARQUET SETTINGS", "FP8 ERROR", "MEMORY", "SUMMARY"):
        assert section in text, section
    r = json.loads(out.read_text())
    s = r["summary"]
    for k in ("write", "size", "fp8_ratio", "memory"):
        assert s[k] > 0, k
    # sizes are exact, whatever the machine: bf16 Arrow carries the payload plus offsets and ids
    # (1.2% at H=256, 0.04% at Kimi's H=7168), fp8 is about half of it
    assert 1.0 <= s["size"] < 1.02
    assert s["fp8_ratio"] <= 0.52
    for col, e in r["results"]["fp8_error"].items():
        assert 0 < e["mean"] < e["max"] <= 2**-4 + 2**-8, col
    # peak RSS does not grow with the number of samples written
    assert s["memory"] <= 1.1


# --- the read-path pieces the benchmark measures -------------------------------------------------

def test_open_dataset_maps_the_shards_in_place(tmp_path, monkeypatch):
    import torch

    from hs_dataset.read.iterate import iter_torch
    from hs_dataset.read.open import open_dataset

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    out = random_build(tmp_path)
    ds = open_dataset(out)
    assert len(ds) == 6
    assert sorted(Path(c["filename"]).resolve() for c in ds.cache_files) == \
        sorted(p.resolve() for p in (out / "data").glob("train-*.arrow"))  # no copy anywhere
    assert not (tmp_path / "hf-cache").exists() or not any((tmp_path / "hf-cache").rglob("*.arrow"))
    a = list(iter_torch(ds, batch_size=4, prefetch=0))
    b = list(iter_torch(ds, batch_size=4, prefetch=2))
    assert [r["id"] for r in a] == [r["id"] for r in b]
    for x, y in zip(a, b):
        assert torch.equal(x["hidden_final"].view(torch.int16), y["hidden_final"].view(torch.int16))


def test_read_ahead_stops_with_the_consumer_and_raises_its_errors():
    import threading
    import time

    import pytest

    from hs_dataset.read.iterate import _read_ahead

    before = threading.active_count()
    for i, _ in enumerate(_read_ahead(iter(range(1000)), 2)):
        if i == 3:
            break
    assert threading.active_count() == before  # joined: no thread left inside a reader at interpreter exit
    produced = []  # with a cost, the items waiting add up to at most the depth: 2 of cost 4 for 10

    def counted():
        for k in range(12):
            produced.append(k)
            yield k

    for k in _read_ahead(counted(), 10, cost=lambda x: 4):
        time.sleep(0.02)
        assert len(produced) <= k + 4, (k, len(produced))  # this one + 2 waiting + 1 blocked in the producer
    assert list(_read_ahead(iter([7]), 10, cost=lambda x: 20)) == [7]  # one always fits

    def failing():
        yield 1
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        list(_read_ahead(failing(), 1))


def test_collator_reuses_a_batch_buffer_only_when_nothing_holds_it():
    import torch

    from hs_dataset.read.collate import DrafterCollator

    H = 1024  # 2 x 2048 x 3H bf16 = 25 MB: above the huge-page threshold

    def sample(T, v):
        return {"input_ids": torch.arange(T, dtype=torch.int32), "loss_mask": torch.ones(T, dtype=torch.uint8),
                "hidden_layer_1": torch.full((T, H), v, dtype=torch.bfloat16),
                "hidden_layer_2": torch.full((T, H), v + 1, dtype=torch.bfloat16),
                "hidden_final": torch.full((T, H), v + 2, dtype=torch.bfloat16)}

    c = DrafterCollator()
    b = c([sample(2048, 1.0), sample(2048, 2.0)])
    ptr = b["aux_hidden_states"].data_ptr()
    del b
    b = c([sample(2048, 3.0), sample(2000, 4.0)])  # the buffer comes back, the padding is zeroed
    assert b["aux_hidden_states"].data_ptr() == ptr
    assert float(b["aux_hidden_states"][1, 1999, 0]) == 4.0 and float(b["aux_hidden_states"][1, 1999, H]) == 5.0
    assert not b["aux_hidden_states"][1, 2000:].any() and not b["hidden_states"][1, 2000:].any()
    held, ptr = b, b["aux_hidden_states"].data_ptr()
    b2 = c([sample(2048, 7.0), sample(2048, 7.0)])  # a batch still held is never overwritten
    assert b2["aux_hidden_states"].data_ptr() != ptr and float(held["aux_hidden_states"][0, 0, 0]) == 3.0
    del held, b
    view, ptr = b2["aux_hidden_states"][0], b2["aux_hidden_states"].data_ptr()
    del b2
    b3 = c([sample(2048, 8.0), sample(2048, 8.0)])  # nor one a view still reads
    assert b3["aux_hidden_states"].data_ptr() != ptr and float(view[0, 0]) == 7.0
    b3["aux_hidden_states"].share_memory_()  # as a DataLoader worker hands it to the main process
    ptr = b3["aux_hidden_states"].data_ptr()
    del b3, view
    assert c([sample(2048, 9.0), sample(2048, 9.0)])["aux_hidden_states"].data_ptr() != ptr
    off = DrafterCollator(reuse_buffers=False)
    assert off([sample(16, 1.0)])["hidden_states"].shape == (1, 16, H) and not off._pool


def test_collator_reuses_two_buffers_in_a_training_loop_whatever_the_batch_length():
    """``for batch in loader`` still holds the last batch while the next one is made: the collator keeps two
    buffers per state, as large as the largest batch yet, and a shorter batch is a view of one of them."""
    import torch

    from hs_dataset.read.collate import DrafterCollator

    H = 1024

    def sample(T, v):
        return {"input_ids": torch.arange(T, dtype=torch.int32), "loss_mask": torch.ones(T, dtype=torch.uint8),
                "hidden_layer_1": torch.full((T, H), v, dtype=torch.bfloat16),
                "hidden_final": torch.full((T, H), v + 1, dtype=torch.bfloat16)}

    c, ptrs, batch = DrafterCollator(), set(), None
    for k, T in enumerate((2048, 1500, 2048, 700, 2048, 300, 2048)):
        previous = batch
        batch = c([sample(T, float(k)), sample(T // 2, float(k))])
        ptrs.add(batch["aux_hidden_states"].data_ptr())
        assert batch["aux_hidden_states"].shape == (2, T, H) and float(batch["aux_hidden_states"][1, T // 2 - 1, 0]) == k
        assert not batch["aux_hidden_states"][1, T // 2:].any()  # the padding written as zeros, whatever was there
        if previous is not None:  # the batch still held was not written over
            assert float(previous["hidden_states"][0, 0, 0]) == k
    assert len(ptrs) == 2
