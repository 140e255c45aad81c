"""Smaller ways a user was misled: a plan of a source whose every row is rejected, reject reasons with their
numbers, control characters of file names, a symlinked shard, a concurrent push's loser."""

from __future__ import annotations

import io
import os
import shutil

import pytest
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub import errors as herr

from hs_dataset.cli.render import print_rejects
from hs_dataset.errors import ForeignFilesError
from hs_dataset.hub.access import hub_error
from hs_dataset.integrity.verify import verify_build
from hs_dataset.layout import DATA_DIR, README_FILE
from hs_dataset.write.driver import build
from tests.fakehub.server import running_hub
from tests.fakehub.tools import hub_client_env
from tests.fixtures.builds import DEMO, config
from tests.fixtures.cli import demo, run, user_error


def test_plan_of_a_source_whose_every_row_is_rejected_exits_2(tiny_model):
    r = run("plan", *demo(tiny_model, "--set", "max_length=4", "--set", "truncation=reject", "--max-samples", "4"))
    last = user_error(r, "no sample would be written", "would be rejected", "the build would stop", cmd="plan")
    assert "rejects:" in r.stdout  # the breakdown is printed before the error
    assert len(last.splitlines()) == 1


def test_the_reject_summary_keeps_the_numbers_of_its_example():
    out = io.StringIO()
    rejects = [{"sample_id": f"s{i}", "field": "loss_mask", "reason": f"length {5 + i} does not match input_ids length 7",
                "stage": "tokenize"} for i in range(3)]
    print_rejects(rejects, 10, file=out)
    text = out.getvalue()
    assert "length 5 does not match input_ids length 7" in text and "s0" in text
    assert text.count("\n") == 3 and "      3  tokenize" in text  # one group of 3: the header, the table head, its row


def test_control_characters_of_a_file_name_are_escaped_in_the_card_and_the_ids(tiny_model, backend, tmp_path):
    source = tmp_path / "evil\x1b[31m\x07\u202egpj.jsonl"
    shutil.copy(DEMO, source)
    out = tmp_path / "out"
    build(config(tiny_model, source=str(source), max_samples=4), out, backend=backend, progress=False,
          build_command=f"hs-dataset build demo --set source={source}")
    card = (out / README_FILE).read_text(encoding="utf-8")
    for raw in ("\x1b", "\x07", "\u202e"):
        assert raw not in card
    assert "evil\\x1b[31m\\x07\\u202egpj" in card
    import datasets

    ids = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "c"))["id"]
    assert ids and all(not any(c in i for c in ("\x1b", "\x07", "\u202e")) for i in ids)
    assert ids[0].startswith("evil\\x1b[31m\\x07\\u202egpj")


def test_a_symlinked_shard_is_refused_by_verify_push_and_build_alike(tiny_model, backend, tmp_path):
    out = tmp_path / "out"
    build(config(tiny_model, max_samples=8), out, backend=backend, progress=False)
    shard = sorted((out / DATA_DIR).iterdir())[0]
    copy = tmp_path / "elsewhere" / shard.name
    copy.parent.mkdir()
    shutil.copyfile(shard, copy)  # the same bytes: every hash matches
    shard.unlink()
    os.symlink(copy, shard)
    report = verify_build(out)
    assert not report.ok and any("symbolic link" in str(p) and shard.name in str(p) for p in report.problems)
    with pytest.raises(ForeignFilesError, match=shard.name):
        build(config(tiny_model, max_samples=8), out, backend=backend, progress=False)
    assert shard.is_symlink() and copy.is_file()  # nothing deleted


def test_the_loser_of_a_concurrent_push_gets_one_clear_line(tmp_path):
    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token="hf_" + "x" * 34):
        api = HfApi()
        api.create_repo("org/race", repo_type="dataset")
        head = api.list_repo_refs("org/race", repo_type="dataset").branches[0].target_commit
        for i in range(2):  # the winner's commit moves main; the loser's parent_commit is stale
            try:
                api.create_commit("org/race", [CommitOperationAdd(f"f{i}.txt", b"x")], repo_type="dataset",
                                  parent_commit=head, commit_message=f"writer {i}")
            except herr.HfHubHTTPError as e:
                err = hub_error(e, repo_id="org/race")
                break
        else:
            raise AssertionError("the second commit was accepted")
    assert err is not None
    text = str(err)
    assert "another push changed the repo while this one ran" in text and "412" in text
    assert "\n" not in text and "Run the same command again" in text
