"""Cheap re-versions: a new version built from an edited or extended source shares nearly all of its
content-defined chunks (the Hub's Xet storage uploads only the others) with the version before it.

The real builder on the tiny model; the states of each distinct token sequence captured once and
replayed (benchmarks/reversions.py's ReplayBackend: on the CPU a sample's states do not depend on its
batch). One row per record batch, as the default byte budget gives rows at Kimi width.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hs_dataset.integrity.checksums import HASH_KEY
from hs_dataset.integrity.verify import read_meta
from hs_dataset.write.driver import build
from tests.fixtures.builds import config

ROOT = Path(__file__).resolve().parents[2]
SAMPLES, PART = 200, 32  # 7 parts, the last one of 8 rows
SHARD = 256 * 1024  # several shards per part

sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import reversions  # the benchmark's sources, replaying backend and comparisons
    from xet_chunks import chunk_file, shared_fraction  # Xet's chunk rule (the benchmark's)
finally:
    sys.path.pop(0)


@pytest.fixture(scope="module")
def versions(tiny_model, tmp_path_factory):
    """v1, v2 (1% of the replies edited), v3 (10% more rows appended): each a fresh build, per file format."""
    work = tmp_path_factory.mktemp("reversions")
    sources = reversions.make_sources(work, SAMPLES)
    backend = reversions.ReplayBackend(tiny_model, (0, 1, 2))
    built: dict[str, dict[str, Path]] = {}

    def get(file_format: str) -> dict[str, Path]:
        if file_format not in built:
            built[file_format] = {}
            for v in ("v1", "v2", "v3"):
                out = work / f"{file_format}-{v}"
                coding = {"file_format": "arrow", "compression": "zstd"} if file_format == "zstd" else \
                    {"file_format": file_format}
                build(config(tiny_model, source=str(getattr(sources, v)), max_samples=None, part_size=PART,
                             writer_batch_bytes=1, max_shard_bytes=SHARD, **coding),
                      out, backend=backend, progress=False)
                built[file_format][v] = out
        return built[file_format]

    yield sources, get
    backend.inner.close()


def shards(out: Path) -> list[Path]:
    return sorted((out / "data").iterdir())


@pytest.mark.parametrize("file_format", ["arrow", "zstd", "parquet"])
def test_a_version_with_1pct_of_its_samples_changed_shares_95pct_of_its_chunks(versions, file_format):
    sources, get = versions
    b = get(file_format)
    assert len(sources.changed) == 2
    assert len(shards(b["v1"])) > 2 * 7  # several shards per part
    s = shared_fraction(shards(b["v1"]), shards(b["v2"]))
    assert s.by_chunks >= 0.95 and s.by_bytes >= 0.95, s
    assert s.upload_bytes < 0.05 * s.bytes
    # the parts holding no changed sample are the same files, byte for byte
    changed_parts = {i // PART for i in sources.changed}
    old = {f["name"]: f[HASH_KEY] for f in read_meta(b["v1"])["shards"]}
    for f in read_meta(b["v2"])["shards"]:
        if int(f["name"].split("-")[1]) not in changed_parts:
            assert old[f["name"]] == f[HASH_KEY], f["name"]


def test_appended_rows_cost_about_their_own_bytes(versions):
    _, get = versions
    b = get("arrow")
    v1, v3 = shards(b["v1"]), shards(b["v3"])
    s = shared_fraction(v1, v3)
    grown = sum(p.stat().st_size for p in v3) - sum(p.stat().st_size for p in v1)
    assert 0 < s.upload_bytes < 1.3 * grown, (s, grown)
    # the full parts of v1 are kept as they are: only the last (partial) part and the new one are new files
    kept = {p.name for p in v1} & {p.name for p in v3}
    assert all(chunk_file(b["v1"] / "data" / n) == chunk_file(b["v3"] / "data" / n) for n in kept
               if not n.startswith(f"train-{SAMPLES // PART:05d}"))


def test_the_xet_client_deduplicates_what_the_chunker_says(versions, tmp_path):
    pytest.importorskip("hf_xet")
    _, get = versions
    b = get("arrow")
    ours = shared_fraction(reversions.published(b["v1"]), reversions.published(b["v2"]))
    xet = reversions.xet_dedup(reversions.published(b["v1"]), reversions.published(b["v2"]), tmp_path / "cas")
    assert xet is not None and xet["total_bytes"] == ours.bytes
    assert xet["deduped_bytes"] / xet["total_bytes"] >= 0.93
    assert abs(xet["deduped_bytes"] / xet["total_bytes"] - ours.by_bytes) < 0.03
