"""Content-defined chunks cut as Xet cuts them (benchmarks/xet_chunks.py, which benchmarks/reversions.py uses), and
what two sets of files share."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import xet_chunks as chunks  # noqa: E402
from xet_chunks import (GEAR_TABLE, MASK, MAX_CHUNK, MIN_CHUNK, TARGET_CHUNK, chunk_boundaries, chunk_bytes,  # noqa: E402
                        chunk_file, shared_fraction)


def xet_rule(data: bytes) -> list[int]:
    """Xet's chunker as its spec writes it, byte by byte (huggingface/xet-core spec/chunking.md): the chunk ends."""
    table = [int(x) for x in GEAR_TABLE]
    h, start, ends = 0, 0, []
    for i, b in enumerate(data):
        h = ((h << 1) + table[b]) & (2**64 - 1)
        size = i + 1 - start
        if size < MIN_CHUNK:
            continue
        if size >= MAX_CHUNK or h & MASK == 0:
            ends.append(i + 1)
            start, h = i + 1, 0
    if start < len(data):
        ends.append(len(data))
    return ends


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_the_parameters_are_xets():
    assert (TARGET_CHUNK, MIN_CHUNK, MAX_CHUNK) == (64 * 1024, 8 * 1024, 128 * 1024)
    assert MASK == 0xFFFF000000000000
    assert GEAR_TABLE.dtype == np.uint64 and GEAR_TABLE.shape == (256,) and len(set(GEAR_TABLE.tolist())) == 256


def test_boundaries_follow_the_byte_by_byte_rule_across_blocks(monkeypatch):
    # a block size that is no multiple of anything: the hash's 63 bytes of history cross many block seams
    monkeypatch.setattr(chunks, "_BLOCK", 100_003)
    data = random_bytes(700_000) + bytes(300_000) + b"\xff" * 20_000 + random_bytes(200_000, seed=1)
    ends = chunk_boundaries(data)
    assert ends.tolist() == xet_rule(data)
    assert len(ends) > 10
    sizes = np.diff(np.concatenate([[0], ends]))
    assert sizes[:-1].min() >= MIN_CHUNK and sizes.max() <= MAX_CHUNK


def test_chunks_average_64_kib_on_random_bytes():
    c = chunk_bytes(random_bytes(16 * 2**20, seed=2))
    mean = c.total / len(c.sizes)
    assert 0.85 * TARGET_CHUNK < mean < 1.15 * TARGET_CHUNK, mean
    assert c.total == 16 * 2**20


def test_an_insertion_changes_only_the_chunks_around_it():
    old = random_bytes(4 * 2**20, seed=3)
    new = old[:2_000_000] + b"seventeen new bytes" + old[2_000_000:]
    s = shared_fraction([chunk_bytes(old)], [chunk_bytes(new)])
    assert s.chunks - s.shared_chunks <= 2  # the chunk holding the insertion (and at most the one after)
    assert s.upload_bytes <= 2 * MAX_CHUNK
    assert s.by_bytes > 0.95 and s.bytes == len(new)
    # the same bytes a fixed-size cut would lose from the insertion on
    fixed = {old[i:i + TARGET_CHUNK] for i in range(0, len(old), TARGET_CHUNK)}
    assert sum(new[i:i + TARGET_CHUNK] in fixed for i in range(0, len(new), TARGET_CHUNK)) < 0.6 * len(fixed)


def test_shared_fraction_counts_bytes_chunks_and_what_an_upload_sends(tmp_path):
    a, b = random_bytes(600_000, seed=4), random_bytes(500_000, seed=5)
    (tmp_path / "a").write_bytes(a)
    (tmp_path / "b").write_bytes(b)
    (tmp_path / "bb").write_bytes(b + b)  # b's chunks twice, and its cut restarting at the seam
    assert chunk_file(tmp_path / "a") == chunk_bytes(a)
    same = shared_fraction([tmp_path / "a"], [tmp_path / "a"])
    assert same.by_bytes == same.by_chunks == 1.0 and same.upload_bytes == 0
    other = shared_fraction([tmp_path / "a"], [tmp_path / "b"])
    assert other.shared_bytes == other.shared_chunks == 0 and other.upload_bytes == other.bytes == len(b)
    twice = shared_fraction([tmp_path / "a"], [tmp_path / "b", tmp_path / "b"])
    assert twice.bytes == 2 * len(b) and twice.upload_bytes == len(b)  # a chunk repeated goes once
    doubled = shared_fraction([tmp_path / "b"], [tmp_path / "bb"])
    assert doubled.by_bytes > 0.6


def test_empty_and_small_inputs(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    assert chunk_file(tmp_path / "empty").sizes == ()
    assert chunk_bytes(b"x" * 100).sizes == (100,)
    nothing = shared_fraction([], [])
    assert (nothing.by_bytes, nothing.by_chunks) == (1.0, 1.0)


@pytest.mark.parametrize("n", [MIN_CHUNK - 1, MIN_CHUNK, MAX_CHUNK, MAX_CHUNK + 1])
def test_sizes_at_the_limits(n):
    data = random_bytes(n, seed=6)
    assert chunk_boundaries(data).tolist() == xet_rule(data)
