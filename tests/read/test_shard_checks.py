"""A damaged shard's rows are never handed out (trust round two, finding 4; round three, finding 2): a flipped
bit or 4 KiB of zeros in the middle of a shard, which the listing, size and row checks of open_dataset cannot
see, stops every tensor reader (iter_torch, TORCH_FORMAT, windows, DataLoader workers) at the block holding
it, naming the shard; the other shards' rows are read as usual. Blocks are checked in the pass that reads
them and no verdict is kept: a bit flipped after a verified read (same size, time and inode) is refused on
the next read, and a reader whose shard is replaced under it (a repair) never serves the old bytes."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from hs_dataset.errors import IntegrityError
from hs_dataset.read import TORCH_FORMAT, DrafterCollator, iter_torch, open_dataset
from hs_dataset.integrity.checksums import BLOCK_BYTES, BLOCK_SIZE_KEY, BLOCKS_KEY
from hs_dataset.read import iterate, safe_views
from hs_dataset.read.safe_views import MIN_MAP_BYTES, SafeViews
from hs_dataset.read.shard_checks import CHECK_ENV
from hs_dataset.read.windows import iter_windows
from hs_dataset.write.driver import build
from tests.fixtures.builds import config, random_build

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
    with pytest.raises(IntegrityError, match=f"{DAMAGED}: block 0 .* differs from the blocks_xxh3_64"):
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


def flip_in_place(p: Path, at: int) -> None:
    """Flip one bit of ``p`` as bit rot does: the same file (inode), size and modification time."""
    st = p.stat()
    with open(p, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = p.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def test_a_bit_flipped_after_a_verified_read_is_refused_on_the_next_read(ref, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    ds = open_dataset(out)
    assert len(list(iter_torch(ds, batch_size=1))) == 24  # a whole verified epoch
    assert len(list(iter_windows(ds, 64))) >= 24
    assert ds.with_format(TORCH_FORMAT)[9]["id"]
    assert not (tmp_path / "cache").exists()  # no verdict kept anywhere
    shard = out / "data" / DAMAGED
    flip_in_place(shard, shard.stat().st_size // 2)
    with pytest.raises(IntegrityError, match=f"{DAMAGED}: block 0"):
        list(iter_torch(ds, batch_size=1))  # the same Dataset object, the next epoch
    with pytest.raises(IntegrityError, match=DAMAGED):
        list(iter_torch(open_dataset(out), batch_size=1))
    with pytest.raises(IntegrityError, match=DAMAGED):
        open_dataset(out).with_format(TORCH_FORMAT)[9]
    with pytest.raises(IntegrityError, match=DAMAGED):
        list(iter_windows(open_dataset(out), 64))


def test_a_reader_of_a_shard_replaced_under_it_never_serves_the_old_bytes(ref, tmp_path):
    """A repair replaces a damaged shard (a new file renamed over it) while a reader still maps the old one."""
    out, bad_ids = damaged_copy(ref, tmp_path, "flip")
    ds = open_dataset(out)  # maps the damaged file
    good = {r["id"]: r for r in iter_torch(open_dataset(ref), batch_size=1)}
    fresh = out / "data" / (DAMAGED + ".repaired")
    shutil.copyfile(ref / "data" / DAMAGED, fresh)
    os.replace(fresh, out / "data" / DAMAGED)  # the repair's rename; the manifest records the intact bytes
    for _ in range(3):  # a reader looping over the dataset it opened before the repair
        served = []
        with pytest.raises(IntegrityError, match=DAMAGED):
            for row in iter_torch(ds, batch_size=1):
                served.append(row["id"])
                assert all(torch.equal(v.view(torch.uint8) if v.dtype == torch.bfloat16 else v,
                                       good[row["id"]][k].view(torch.uint8) if v.dtype == torch.bfloat16
                                       else good[row["id"]][k]) for k, v in row.items() if isinstance(v, torch.Tensor))
        assert not set(served) & bad_ids
    assert len(list(iter_torch(open_dataset(out), batch_size=1))) == 24  # opened again: the repaired file


def test_a_build_of_format_1_is_hashed_whole_at_open(ref, tmp_path):
    """Builds recorded before block hashes keep working: each shard's whole xxh3_128 is checked when it is opened."""
    out = tmp_path / "old"
    shutil.copytree(ref, out)
    meta = json.loads((out / "hs_dataset.json").read_text())
    meta["format_version"] = 1
    for s in meta["shards"]:
        s.pop(BLOCKS_KEY)
        s.pop(BLOCK_SIZE_KEY)
    (out / "hs_dataset.json").write_text(json.dumps(meta))
    assert [r["id"] for r in iter_torch(open_dataset(out))] == [r["id"] for r in iter_torch(open_dataset(ref))]
    flip_in_place(out / "data" / DAMAGED, 1000)
    with pytest.raises(IntegrityError, match=f"{DAMAGED}: its content hash differs from the xxh3_128"):
        open_dataset(out)


def test_a_flip_in_a_block_beyond_the_value_read_is_refused(tmp_path, monkeypatch):
    """Values of 1 MiB and more are mapped privately (hs_dataset.read.safe_views) and their blocks hashed from there;
    a block under a value reaches beyond it (the neighbouring row's bytes): those bytes are hashed too, from the
    shard's own mapping, so a flip there refuses the value although the value's own bytes are intact."""
    out = random_build(tmp_path, samples=3, tokens=1000, hidden=528, part_size=4)  # 1,056,000-byte values
    shard = out / "data" / "train-00000-000.arrow"
    col = next(c for c in open_dataset(out).column_names if c.startswith("hidden_"))
    value = next(iter_torch(open_dataset(out).select([1]), batch_size=1))[col].clone()  # maps no page
    raw = bytes(value.contiguous().view(torch.uint8).numpy())
    data = shard.read_bytes()
    at = data.find(raw)
    assert at > 0 and data.find(raw, at + 1) == -1 and len(raw) >= MIN_MAP_BYTES
    end = at + len(raw)
    edge = at - 1 if at % BLOCK_BYTES else end  # a byte of the value's first or last block, outside the value
    assert edge // BLOCK_BYTES in (at // BLOCK_BYTES, (end - 1) // BLOCK_BYTES)
    with monkeypatch.context() as m:  # the edge is hashed where the shard is mapped, not read into a copy
        m.setattr(os, "pread", lambda *a: pytest.fail("a block's edge was copied with os.pread"))
        assert torch.equal(next(iter_torch(open_dataset(out).select([1]), batch_size=1))[col], value)
    flip_in_place(shard, edge)
    block = f"{shard.name}: block {edge // BLOCK_BYTES} "
    with pytest.raises(IntegrityError, match=block):
        next(iter_torch(open_dataset(out).select([1]), batch_size=1))  # read ahead: read in and hashed in parts
    with pytest.raises(IntegrityError, match=block):
        open_dataset(out).with_format(TORCH_FORMAT)[1]


def test_a_value_read_from_the_disk_in_parts_has_every_part_checked(tmp_path, monkeypatch):
    """The read-ahead reads a value in and hashes it a part at a time (safe_views._PIPE_BYTES, here one block): a flip
    in a middle part is refused, and an intact value reads whole."""
    out = random_build(tmp_path, samples=3, tokens=4000, hidden=528, part_size=4)  # 4,224,000-byte values
    shard = out / "data" / "train-00000-000.arrow"
    col = next(c for c in open_dataset(out).column_names if c.startswith("hidden_"))
    value = next(iter_torch(open_dataset(out).select([1]), batch_size=1))[col].clone()
    raw = bytes(value.contiguous().view(torch.uint8).numpy())
    at = shard.read_bytes().find(raw)
    assert at > 0 and len(raw) > 3 * BLOCK_BYTES
    monkeypatch.setattr(safe_views, "_PIPE_BYTES", BLOCK_BYTES)
    assert torch.equal(next(iter_torch(open_dataset(out).select([1]), batch_size=1))[col], value)
    middle = (at // BLOCK_BYTES + 2) * BLOCK_BYTES + 7  # in the value's third block, a part of its own
    assert at < middle < at + len(raw)
    flip_in_place(shard, middle)
    with pytest.raises(IntegrityError, match=f"{shard.name}: block {middle // BLOCK_BYTES} "):
        next(iter_torch(open_dataset(out).select([1]), batch_size=1))


@pytest.mark.parametrize("rows", [None, [3, 0, 2]], ids=["in order", "shuffled"])
def test_the_read_ahead_asks_the_disk_for_the_next_rows_before_reading_a_row_and_for_nothing_else(tmp_path, monkeypatch,
                                                                                                 rows):
    """Before the read-ahead reads a row's states in (and hashes them), the disk has been asked for the next rows'
    states (iterate._ASK_AHEAD_BYTES of them, here one row), so that it reads on meanwhile; it is asked for exactly
    the states the loop reads, in any order."""
    out = random_build(tmp_path, samples=4, tokens=2000, hidden=528, part_size=4)  # 2,112,000-byte values
    log: list[tuple[str, int, int]] = []
    real_read, real_ask = SafeViews._populate_and_check, os.posix_fadvise

    def read_in(views, m, where, nbytes):
        log.append(("read", where[2], nbytes))
        real_read(views, m, where, nbytes)

    def ask(fd, offset, n, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            log.append(("ask", offset, n))
        real_ask(fd, offset, n, advice)
    monkeypatch.setattr(iterate, "_ASK_AHEAD_BYTES", 1)
    monkeypatch.setattr(SafeViews, "_populate_and_check", read_in)
    monkeypatch.setattr(os, "posix_fadvise", ask)
    ds = open_dataset(out) if rows is None else open_dataset(out).select(rows)
    states = len([c for c in ds.column_names if c.startswith("hidden_")])
    assert len(list(iter_torch(ds, batch_size=1))) == len(ds)
    reads = [(a, n) for what, a, n in log if what == "read"]
    asks = [(a, n) for what, a, n in log if what == "ask"]
    assert len(reads) == len(ds) * states and sorted(asks) == sorted(reads)  # what is read, nothing else
    first_read = log.index(("read", *reads[0]))
    assert set(asks[:2 * states]) == set(reads[:2 * states])  # the first row and the next, in the loop's order
    assert {("ask", a, n) for a, n in reads[:2 * states]} <= set(log[:first_read])  # before the first is read
