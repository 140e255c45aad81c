"""A build never deletes what it did not write (trust round two, finding 1): an existing --output that is not
a build, a source inside the output, a data/ that is a link, a foreign file in a build's data/ are refused in
one line before anything is touched; the user's files are all still there, byte for byte."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from hs_dataset.write.driver import build
from hs_dataset.errors import ForeignFilesError
from tests.fixtures.builds import DEMO, config
from tests.fixtures.cli import demo, run, user_error


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (links not followed) with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and not p.is_symlink()}


def user_folder(root: Path) -> Path:
    """A project folder with a data/ subfolder of the user's own files (the attack's case)."""
    (root / "data" / "sub").mkdir(parents=True)
    (root / "data" / "my_notes.txt").write_text("notes")
    (root / "data" / "table.csv").write_text("a,b\n1,2\n")
    (root / "data" / "sub" / "keep.txt").write_text("keep")
    return root


def test_a_folder_that_is_not_a_build_is_refused_untouched(tiny_model, tmp_path):
    proj = user_folder(tmp_path / "proj")
    before = snapshot(proj)
    r = run("build", *demo(tiny_model, "--max-samples", "2"), "--output", str(proj))
    last = user_error(r, str(proj), "not an hs_dataset build", "new or empty directory")
    assert "data" in last
    assert snapshot(proj) == before and sorted(os.listdir(proj)) == ["data"]  # not even a .hs_build/


def test_a_source_inside_the_output_is_refused(tiny_model, tmp_path):
    proj = tmp_path / "proj2"
    (proj / "data").mkdir(parents=True)
    src = proj / "data" / "convs.jsonl"
    shutil.copy(DEMO, src)
    before = snapshot(proj)
    r = run("build", *demo(tiny_model, "--max-samples", "2", "--set", f"source={src}"), "--output", str(proj))
    user_error(r, "lies inside the output directory", str(src))
    assert snapshot(proj) == before
    # also when the output is a build of ours already
    out = tmp_path / "out"
    build(config(tiny_model, max_samples=4), out, progress=False)
    inside = out / "convs.jsonl"
    shutil.copy(DEMO, inside)
    with pytest.raises(ForeignFilesError, match="inside the output"):
        build(config(tiny_model, max_samples=4, source=str(inside)), out, progress=False)
    assert inside.read_bytes() == DEMO.read_bytes()


def test_a_data_folder_that_is_a_link_is_never_followed(tiny_model, tmp_path):
    elsewhere = user_folder(tmp_path / "elsewhere") / "data"
    before = snapshot(elsewhere)
    proj = tmp_path / "proj3"
    out = tmp_path / "built"
    build(config(tiny_model, max_samples=4), out, progress=False)  # a build of ours, whose data/ is then a link
    shutil.rmtree(out / "data")
    (out / "data").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ForeignFilesError, match="is a link"):
        build(config(tiny_model, max_samples=4), out, progress=False)
    proj.mkdir()
    (proj / "data").symlink_to(elsewhere, target_is_directory=True)
    r = run("build", *demo(tiny_model, "--max-samples", "2"), "--output", str(proj))
    user_error(r, "not an hs_dataset build")
    assert snapshot(elsewhere) == before


@pytest.mark.parametrize("what", ["file", "folder", "link"])
def test_a_foreign_entry_in_a_builds_data_is_refused_not_deleted(tiny_model, tmp_path, what):
    out = tmp_path / "out"
    build(config(tiny_model, max_samples=8), out, progress=False)
    data = out / "data"
    if what == "file":
        (data / "my_notes.txt").write_text("mine")
    elif what == "folder":
        (data / "sub").mkdir()
        (data / "sub" / "keep.txt").write_text("keep")
    else:
        (tmp_path / "target.txt").write_text("target")
        (data / "train-00009-000.arrow").symlink_to(tmp_path / "target.txt")  # a shard's name, but a link
    before = snapshot(out)
    with pytest.raises(ForeignFilesError, match="was not written by hs_dataset"):
        build(config(tiny_model, max_samples=8), out, progress=False)
    assert snapshot(out) == before
    assert (tmp_path / "target.txt").read_text() == "target" if what == "link" else True


def test_a_copy_named_like_a_shard_is_refused_not_deleted(tiny_model, tmp_path):
    """A file named like a shard that no record of the build lists (a copy put in data/ by hand) is not
    provably the build's: refused, untouched (recovery used to delete any shard-named file)."""
    out = tmp_path / "out"
    build(config(tiny_model, max_samples=8), out, progress=False)
    data = out / "data"
    shutil.copyfile(data / "train-00000-000.arrow", data / "train-00007-000.arrow")
    before = snapshot(out)
    with pytest.raises(ForeignFilesError, match="named like a shard, but no record of this build lists it"):
        build(config(tiny_model, max_samples=8), out, progress=False)
    assert snapshot(out) == before


def test_shards_moved_before_their_record_are_removed_on_the_proof_of_the_move_note(tiny_model, tmp_path):
    """A kill between moving a part's shards into data/ and writing its record: the move note written before
    the move proves they are the build's, so the rerun removes them and redoes the part."""
    from hs_dataset.write.resume import note_moving, part_record
    from tests.fixtures.builds import content_hash

    out, ref = tmp_path / "out", tmp_path / "ref"
    build(config(tiny_model, max_samples=8), ref, progress=False)
    build(config(tiny_model, max_samples=8), out, progress=False)
    state = out / ".hs_build"
    names = [f.name for f in sorted((out / "data").glob("train-00001-*.arrow"))]
    assert names
    part_record(state, 1).unlink()  # as if killed after the move, before the record
    (out / "hs_dataset.json").unlink()
    note_moving(state, 1, names)
    shutil.copyfile(out / "data" / names[0], out / "data" / "train-00007-000.arrow")  # and a copy by hand
    with pytest.raises(ForeignFilesError, match="train-00007-000.arrow"):
        build(config(tiny_model, max_samples=8), out, progress=False)
    assert (state / "parts" / "moving-00001.json").is_file()  # a refusal touches nothing: the proof stays
    (out / "data" / "train-00007-000.arrow").unlink()  # the user moves the copy away, as told
    s = build(config(tiny_model, max_samples=8), out, progress=False)
    assert (s.parts_built, s.parts_skipped) == (1, 1)
    assert not list((state / "parts").glob("moving-*.json"))
    assert content_hash(out) == content_hash(ref)


def test_an_empty_folder_and_a_build_of_ours_are_accepted(tiny_model, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    s = build(config(tiny_model, max_samples=4), empty, progress=False)
    assert s.counts.written == 4
    again = build(config(tiny_model, max_samples=8), empty, progress=False)  # resumes and grows: ours
    assert again.counts.written == 8
