"""A damaged shard's rows are never handed out (trust round two, finding 4): a flipped bit or 4 KiB of
zeros in the middle of a shard, which the listing, size and row checks of open_dataset cannot see, stops
every tensor reader (iter_torch, TORCH_FORMAT, DataLoader workers) before the first row of that shard,
naming it; the other shards' rows are read as usual, and each shard is hashed once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from hs_dataset.errors import IntegrityError
from hs_dataset.read import TORCH_FORMAT, DrafterCollator, iter_torch, open_dataset
from hs_dataset.read.shard_checks import CHECK_ENV
from hs_dataset.write.driver import build
from tests.fixtures.builds import config

DAMAGED = "train-00002-000.arrow"


@pytest.fixture(scope="module")
def ref(tiny_model, backend, tmp_path_factory):
    out = tmp_path_factory.mktemp("checks") / "ref"
    build(config(tiny_model), out, backend=backend, progress=False)  # 6 parts of 4 rows, one shard each
    return out


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Verdicts of this test only (the markers live under XDG_CACHE_HOME)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(CHECK_ENV, raising=False)


def damaged_copy(ref: Path, tmp_path: Path, fault: str) -> tuple[Path, set[str]]:
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    p = out / "data" / DAMAGED
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.seek(size // 2)
        if fault == "flip":
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x04]))
        else:
            f.write(b"\0" * min(4096, size // 4))
    shards = json.loads((out / "hs_dataset.json").read_text())["shards"]
    first = sum(s["rows"] for s in shards[:2])
    ids = set(open_dataset(out)["id"][first:first + shards[2]["rows"]])  # the damaged shard's rows
    return out, ids


@pytest.mark.parametrize("fault", ["flip", "zero"])
def test_no_row_of_a_damaged_shard_is_handed_out(ref, tmp_path, fault, monkeypatch):
    out, bad_ids = damaged_copy(ref, tmp_path, fault)
    got = []
    with pytest.raises(IntegrityError, match=f"{DAMAGED}: its content hash differs"):
        for row in iter_torch(open_dataset(out), batch_size=1):
            got.append(row["id"])
    assert len(got) == 8 and not set(got) & bad_ids  # the two shards before it, none of its own rows
    ds = open_dataset(out).with_format(TORCH_FORMAT)
    assert ds[0]["id"] == got[0]  # an intact shard's row
    with pytest.raises(IntegrityError, match=DAMAGED):
        ds[9]
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=DrafterCollator())
    with pytest.raises(IntegrityError, match=DAMAGED):
        list(loader)
    streamed = []
    with pytest.raises(IntegrityError, match=DAMAGED):  # streaming over the local build's shards: the same
        for row in iter_torch(open_dataset(out, streaming=True), batch_size=1):
            streamed.append(row["id"])
    assert streamed == got
    monkeypatch.setenv(CHECK_ENV, "0")  # the check is what stops it: without it the damaged rows are served
    assert len(list(iter_torch(open_dataset(out), batch_size=1))) == 24


def test_an_intact_build_is_hashed_once_and_read_as_before(ref, tmp_path):
    rows = [r["id"] for r in iter_torch(open_dataset(ref))]
    markers = sorted((tmp_path / "cache" / "hs_dataset" / "verified").rglob("*"))
    verdicts = [m for m in markers if m.is_file() and not m.name.endswith(".lock")]
    assert len(rows) == 24 and len(verdicts) == 6  # one verdict per shard
    mtimes = [m.stat().st_mtime_ns for m in verdicts]
    again = [r["id"] for r in iter_torch(open_dataset(ref))]
    assert again == rows and [m.stat().st_mtime_ns for m in verdicts] == mtimes  # not hashed again
