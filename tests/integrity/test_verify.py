"""Nothing wrong is served or published (issue 12): a shard with a flipped bit, a zeroed block, cut
short, deleted or duplicated in a finished build is named by ``hs-dataset verify``, refused by
``push`` and (missing / extra) by the readers, and the next build repairs it to the rows of an
uninterrupted build. A published version is verified after download, or from the Hub's listing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

from hs_dataset.write.driver import build
from hs_dataset.errors import ForeignFilesError, IntegrityError
from hs_dataset.hub.publish import push_dataset
from hs_dataset.hub.verify_remote import verify_repo
from hs_dataset.integrity.checksums import shard_entry
from hs_dataset.integrity.verify import repair_command, verify_build
from hs_dataset.layout import DAMAGED_FILE, STATE_DIR
from hs_dataset.read.open import open_dataset
from tests.fakehub.server import running_hub
from tests.fakehub.tools import client_subprocess_env, hub_client_env, make_rows, write_built_dataset
from tests.fixtures.builds import config, content_hash

ROOT = Path(__file__).resolve().parents[2]
REPO = "org/verified-hs"
TOKEN = "hf_IntegrityTestToken0123456789ABCDEFGH"
SHARD = "train-00002-000.arrow"  # the shard every fault damages (part 2)


@pytest.fixture(scope="module")
def finished(tiny_model, backend, tmp_path_factory):
    """An uninterrupted build and its content hash."""
    out = tmp_path_factory.mktemp("integrity") / "ref"
    build(config(tiny_model), out, backend=backend, progress=False, build_command="hs-dataset build demo -o ref")
    return out, content_hash(out)


def damage(out: Path, fault: str) -> str:
    """Damage ``out``'s data/ as a careless user or a failing disk would; returns the file to name."""
    p = out / "data" / SHARD
    size = p.stat().st_size
    if fault == "flip":
        with open(p, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0x10]))
    elif fault == "zero":
        with open(p, "r+b") as f:
            f.seek(size // 3)
            f.write(b"\0" * 4096)
    elif fault == "truncate":
        with open(p, "r+b") as f:
            f.truncate(size - 1000)
    elif fault == "delete":
        p.unlink()
    elif fault == "duplicate":
        copy = out / "data" / "train-00002-001.arrow"  # looks like a second shard of part 2: readers load it
        shutil.copy(p, copy)
        return copy.name
    return SHARD


FAULTS = ["flip", "zero", "truncate", "delete", "duplicate"]


@pytest.mark.parametrize("fault", FAULTS)
def test_a_damaged_shard_is_named_refused_and_repaired(finished, tiny_model, backend, tmp_path, fault):
    ref, ref_hash = finished
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    named = damage(out, fault)

    report = verify_build(out)
    assert not report.ok and [p.path for p in report.problems] == [f"data/{named}"], report.message()
    msg = report.message()
    # the shard, and the command that repairs it: the copy's, not the original's -o ref
    assert named in msg and f"(`hs-dataset build demo -o {out}`) on {out}" in msg and "-o ref" not in msg
    if fault == "duplicate":
        assert report.parts == [] and "not listed" in msg and f"Move {out / 'data' / named} out of" in msg
    else:
        assert report.parts == [2] and "part(s) [2]" in msg

    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        before = hub.dump_state()
        with pytest.raises(IntegrityError) as e:
            push_dataset(out, REPO, "v1.0")
        assert named in str(e.value) and "refusing to push" in str(e.value) and f"demo -o {out}" in str(e.value)
        assert hub.dump_state() == before  # refused before anything was sent

    if fault in ("delete", "duplicate", "truncate"):  # the readers see the count (or size) is off
        with pytest.raises(IntegrityError, match=named.replace(".", r"\.")):
            open_dataset(out)
        with pytest.raises(IntegrityError, match=named.replace(".", r"\.")):
            open_dataset(out, streaming=True)

    if fault == "duplicate":  # a copy named like a shard is not the build's to delete: refused, untouched
        with pytest.raises(ForeignFilesError, match=f"{named}.*named like a shard"):
            build(config(tiny_model), out, backend=backend, progress=False)
        assert (out / "data" / named).is_file()
        (out / "data" / named).unlink()  # the user moves it away, as the refusal says
    s = build(config(tiny_model), out, backend=backend, progress=False)
    assert (s.parts_built, s.parts_skipped) == ((0, 6) if fault == "duplicate" else (1, 5))
    assert verify_build(out).ok
    assert not (out / STATE_DIR / DAMAGED_FILE).exists()
    assert content_hash(out) == ref_hash


def flip_middle(shard: Path) -> None:
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 1]))


def test_a_flip_beyond_the_quick_check_is_found_by_verify_by_a_rerun_and_by_the_readers(tiny_model, backend,
                                                                                         tmp_path):
    """A resumed build checks 2 MiB of each shard it keeps while it builds others; a bit flipped in the
    middle of a larger shard is found by the full check: of verify and push (which mark the part), of a
    rerun with nothing left to build (which rebuilds it), and of the readers before they hand out a row."""
    from hs_dataset.read import TORCH_FORMAT, iter_torch

    cfg = config(tiny_model, part_size=48, max_samples=64)
    ref, out = tmp_path / "ref", tmp_path / "out"
    build(cfg, ref, backend=backend, progress=False)
    build(cfg, out, backend=backend, progress=False)
    shard = out / "data" / "train-00000-000.arrow"
    assert shard.stat().st_size > 3 * 2**20  # the middle is beyond the first and last MiB
    flip_middle(shard)
    assert verify_build(out, quick=True).ok  # the documented blind spot of the quick check
    with pytest.raises(IntegrityError, match=r"train-00000-000.arrow: block \d+ .* differs from the blocks_xxh3_64"):
        next(iter(iter_torch(open_dataset(out))))
    with pytest.raises(IntegrityError, match="train-00000-000.arrow"):
        open_dataset(out).with_format(TORCH_FORMAT)[0]

    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "verify", str(out)], capture_output=True, text=True)
    assert r.returncode == 1 and "train-00000-000.arrow" in r.stdout and "content hash" in r.stdout, r.stdout + r.stderr
    assert "part(s) [0]" in r.stdout
    assert json.loads((out / STATE_DIR / DAMAGED_FILE).read_text()).keys() == {"0"}
    s = build(cfg, out, backend=backend, progress=False)
    assert (s.parts_built, s.parts_skipped) == (1, 1)
    assert verify_build(out).ok and content_hash(out) == content_hash(ref)

    flip_middle(shard)  # again, and no verify first: the rerun itself, with nothing to build, finds it
    s = build(cfg, out, backend=backend, progress=False)
    assert (s.parts_built, s.parts_skipped) == (1, 1)
    assert verify_build(out).ok and content_hash(out) == content_hash(ref)
    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "verify", str(out), "--quick"], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "all match" in r.stdout


@pytest.mark.parametrize("change", ["features", "rejects"])
def test_the_card_and_rejects_are_verified_before_a_push(finished, tiny_model, backend, tmp_path, change):
    """Everything a push uploads is checked: the card's front matter (the features load_dataset reads)
    and rejects.jsonl must be what hs_dataset.json says; the rerun of the build rewrites them."""
    ref, _ = finished
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    if change == "features":
        readme = out / "README.md"
        text = readme.read_text()
        assert "dtype: uint16" in text
        readme.write_text(text.replace("dtype: uint16", "dtype: int32", 1))
        named = "README.md"
    else:
        with open(out / "rejects.jsonl", "a") as f:
            f.write(json.dumps({"sample_id": "x:1", "field": "row", "reason": "made up", "stage": "source"}) + "\n")
        named = "rejects.jsonl"
    report = verify_build(out)
    assert not report.ok and [p.path for p in report.problems] == [named], report.message()
    assert ("int32" in report.message()) == (change == "features")
    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        before = hub.dump_state()
        with pytest.raises(IntegrityError, match=named.replace(".", r"\.")):
            push_dataset(out, REPO, "v1.0")
        assert hub.dump_state() == before
    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "verify", str(out)], capture_output=True, text=True)
    assert r.returncode == 1 and named in r.stdout
    assert build(config(tiny_model), out, backend=backend, progress=False).parts_built == 0  # rewrites them
    assert verify_build(out).ok
    if change == "rejects":
        assert (out / named).read_bytes() == (ref / named).read_bytes()
    else:  # the card names its own folder; its front matter is the reference build's
        assert (out / named).read_text().split("\n---\n")[0] == (ref / named).read_text().split("\n---\n")[0]


def test_a_shard_edited_with_its_records_in_the_manifest_and_card_fails_verify_and_push(finished, tmp_path):
    """Issue 48, finding 3: a shard flipped together with its hashes in hs_dataset.json (whole, edges and
    blocks) and in the card's checksum table still disagrees with the part record the build wrote."""
    ref, _ = finished
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    damage(out, "flip")
    meta = json.loads((out / "hs_dataset.json").read_text())
    entry = next(s for s in meta["shards"] if s["name"] == SHARD)
    old = entry["xxh3_128"]
    entry.update({k: v for k, v in shard_entry(out / "data" / SHARD).items() if k != "name"})
    assert entry["xxh3_128"] != old
    (out / "hs_dataset.json").write_text(json.dumps(meta, indent=1))
    card = (out / "README.md").read_text()
    assert old in card
    (out / "README.md").write_text(card.replace(old, entry["xxh3_128"]))
    report = verify_build(out)
    assert not report.ok and report.parts == [2], report.message()
    assert f"data/{SHARD} its xxh3_128" in report.message() and ".hs_build/parts/part-00002.json" in report.message()
    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        before = hub.dump_state()
        with pytest.raises(IntegrityError, match=SHARD):
            push_dataset(out, REPO, "v1.0")
        assert hub.dump_state() == before


def test_a_file_the_build_did_not_write_is_named_and_never_uploaded(finished, tmp_path):
    """A push uploads only what verify checked: a file beside the build's own (a note at the top, a folder
    of plots) fails verify by name, and the push is refused before anything reaches the Hub."""
    ref, _ = finished
    out = tmp_path / "out"
    shutil.copytree(ref, out)
    (out / "notes.txt").write_text("my notes")
    (out / "plots").mkdir()
    (out / "plots" / "norms.png").write_bytes(b"png")
    report = verify_build(out)
    assert not report.ok and [p.path for p in report.problems] == ["notes.txt", "plots/norms.png"], report.message()
    assert "push would upload it unchecked" in report.message()
    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        before = hub.dump_state()
        with pytest.raises(IntegrityError, match=r"notes\.txt"):
            push_dataset(out, REPO, "v1.0")
        assert hub.dump_state() == before
    (out / "notes.txt").unlink()
    shutil.rmtree(out / "plots")
    assert verify_build(out).ok


def test_a_published_version_is_verified_after_download(finished, tmp_path):
    ref, _ = finished
    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        push_dataset(ref, REPO, "v1.0")
        meta = json.loads((ref / "hs_dataset.json").read_text())
        card = hub.read_file("dataset", REPO, "README.md", "v1.0").decode()
        for s in meta["shards"]:  # the card carries every shard's hash too
            assert s["xxh3_128"] in card and s["name"] in card
        assert f"hs-dataset verify {REPO} --revision v1.0" in card

        env = client_subprocess_env(hub, tmp_path / "subhome", token=TOKEN)
        env["PYTHONPATH"] = str(ROOT)
        cli = [sys.executable, "-m", "hs_dataset.cli", "verify", REPO, "--revision", "v1.0"]
        r = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0 and "6 shards, 24 rows: all match" in r.stdout, r.stdout + r.stderr

        # versions whose files differ from their hs_dataset.json: a shard changed, one missing, one extra
        api = HfApi()
        data = bytearray((ref / "data" / SHARD).read_bytes())
        data[len(data) // 2] ^= 0x40
        for branch, ops in {
            "changed": [CommitOperationAdd(f"data/{SHARD}", bytes(data))],
            "missing": [CommitOperationDelete(f"data/{SHARD}")],
            "extra": [CommitOperationAdd("data/train-00002-001.arrow", str(ref / "data" / SHARD))],
        }.items():
            api.create_branch(REPO, repo_type="dataset", branch=branch, revision="v1.0")
            api.create_commit(REPO, ops, repo_type="dataset", revision=branch, commit_message=branch)
            report = verify_repo(REPO, revision=branch, local_dir=tmp_path / f"dl-{branch}")
            assert not report.ok and len(report.problems) == 1, report.message()
            assert ("train-00002-001.arrow" if branch == "extra" else SHARD) in report.message()
            quick = verify_repo(REPO, revision=branch, quick=True)  # the Hub's listing: names and sizes
            assert quick.ok == (branch == "changed")
            if branch != "changed":
                for streaming in (True, False):
                    with pytest.raises(IntegrityError, match="train-00002"):
                        open_dataset(REPO, revision=branch, streaming=streaming)
        r = subprocess.run(cli[:-1] + ["changed"], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 1 and "content hash" in r.stdout and SHARD in r.stdout
        good = open_dataset(REPO, revision="v1.0", streaming=True)
        assert sum(1 for _ in good) == 24


REPAIRS = {  # recorded command -> the command that repairs /new/copy
    "hs-dataset build demo.py -o /old/ref": "hs-dataset build demo.py -o /new/copy",
    "hs-dataset build demo.py --output /old/ref --push o/r": "hs-dataset build demo.py --output /new/copy --push o/r",
    "hs-dataset build demo.py --output=/old/ref": "hs-dataset build demo.py --output=/new/copy",
    "hs-dataset build demo.py -o/old/ref": "hs-dataset build demo.py -o/new/copy",
    "hs-dataset build demo.py --out /old/ref --on-nonfinite reject": "hs-dataset build demo.py --out /new/copy "
                                                                        "--on-nonfinite reject",
    "hs-dataset build demo.py --set max_length=512": "hs-dataset build demo.py --set max_length=512 --output /new/copy",
    "hs-dataset import sf --from specforge /old/ref --model m": "hs-dataset import sf --from specforge /new/copy --model m",
    "hs-dataset build 'my demo.py' -o /old/ref": "hs-dataset build 'my demo.py' -o /new/copy",
}


@pytest.mark.parametrize("recorded", list(REPAIRS))
def test_the_repair_command_writes_the_directory_verified(recorded):
    assert repair_command(recorded, Path("/new/copy")) == REPAIRS[recorded]


def test_a_copied_build_is_told_to_repair_the_copy_by_verify_and_push(tmp_path):
    """A build copied elsewhere keeps its recorded command (``--output`` of the original): the repair of
    ``verify``, of the CLI's ``verify`` and of push's refusal names the copy (issue 27, finding 9)."""
    original = tmp_path / "original"
    write_built_dataset(original, make_rows(12), shard_rows=4,
                        build_command=f"hs-dataset build demo.py --output {original} --set max_length=512")
    (original / STATE_DIR / "parts").mkdir()  # a local build's state
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    (copy / "data" / "train-00001-00003.arrow").unlink()
    want = f"Repair: run the build command again (`hs-dataset build demo.py --output {copy} --set max_length=512`) " \
           f"on {copy}: it rebuilds part(s) [1]"

    msg = verify_build(copy).message()
    assert want in msg and str(original) not in msg, msg
    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "verify", str(copy)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 1 and want in r.stdout and str(original) not in r.stdout, r.stdout + r.stderr
    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        with pytest.raises(IntegrityError) as e:
            push_dataset(copy, REPO, "v1.0")
    assert "refusing to push" in str(e.value) and want in str(e.value) and str(original) not in str(e.value)
