"""Version names that would shadow a git ref on the Hub are refused, naming the rule (issue 12), and so
are abbreviated commit ids, over-long names, '/' and anything but ASCII letters, digits, '.', '_', '-'
(issue 27); a forced push killed between deleting the old tag and creating the new one resumes into
the version."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from hs_dataset.write.card import parse_history
from hs_dataset.errors import VersionNameError
from hs_dataset.hub.names import MAX_LENGTH, _git_problem, check_version_name, version_name_problem
from hs_dataset.hub.publish import push_dataset
from tests.fakehub.server import running_hub
from tests.fakehub.tools import hub_client_env, make_rows, run_killed_client, write_built_dataset

ROOT = Path(__file__).resolve().parents[2]
REPO = "org/versions-hs"
TOKEN = "hf_VersionsTestToken0123456789ABCDEFGH"

# name -> words of the rule its refusal must name
REFUSED = {
    "main": "branch main", "Main": "branch main", "HEAD": "HEAD", "head": "HEAD", "FETCH_HEAD": "HEAD",
    "refs/tags/v1": "refs/", "refs/heads/main": "refs/", "hs-dataset/v1.0": "work branches",
    "0123456789abcdef0123456789abcdef01234567": "commit id", "ABCDEF0123456789ABCDEF0123456789ABCDEF01": "commit id",
    "@": "'@'", "v1@2": "'@'", "v1@{0}": "'@'", "": "empty", "-v1": "option",
    "v1..0": "'..'", "v1 0": "' '", "v1.lock": ".lock", "a/b.lock/c": ".lock", ".v1": "starting with '.'",
    "a/.b": "starting with '.'", "v1/": "'/'", "/v1": "'/'", "a//b": "'/'", "v1.": "ends with '.'",
    "v1~1": "'~'", "v1^": "'^'", "v1:0": "':'", "v1?": "'?'", "v1*": "'*'", "v1[0": "'['", "v1\\0": "'\\\\'",
    "v1\x7f": "'\\x7f'", "v1\t": "'\\t'",
    # issue 27: abbreviated commit ids (digits only included), '/', non-ASCII, a bad first character
    "50d617e": "commit id", "deadbeef": "commit id", "1234567": "commit id", "20241130": "commit id",
    "a/b": "'/'", "pr/1": "refs/pr/N", "release/v1": "'/'", "v1.0-ü": "only ASCII letters, digits", "vé": "'é'",
    "v1+2": "'+'", "v1,2": "','", "_v1": "starts with '_'",
}
ACCEPTED = ["v1.0", "v2.0-rc1", "2024.11.30", "abcdef", "123456", "v1_final", "kimi-k2.5-hs-v3", "V1.0",
            "0.1", "x" * 128]


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_version_name_that_shadows_a_ref_is_refused_naming_the_rule(name, tmp_path):
    build = write_built_dataset(tmp_path / "b", make_rows(2))
    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        with pytest.raises(VersionNameError) as e:
            push_dataset(build, REPO, name)
        assert hub.dump_state() == {} and hub.request_log == []  # refused before the first request
    assert f"invalid version name {name!r}" in str(e.value) and REFUSED[name] in str(e.value), str(e.value)


def test_valid_names_pass_and_the_git_rules_agree_with_git():
    for name in ACCEPTED:
        assert version_name_problem(name) is None, name
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed: cannot compare with git check-ref-format")
    for name in [*REFUSED, *ACCEPTED, "a.b/c", "x/y/z", "v1.0.lock2", "ref@x", "a..", "@{", "v1\x01"]:
        if not name:
            continue
        r = subprocess.run([git, "check-ref-format", f"refs/tags/{name}"], capture_output=True)
        assert (r.returncode == 0) == (_git_problem(name) is None), (name, r.returncode, _git_problem(name))


def test_an_abbreviated_commit_id_of_the_repo_is_refused(tmp_path):
    """``50d617e``, the first 7 hex digits of v1.0's commit, names that commit on the Hub: a tag of that
    name would shadow it (``revision="50d617e"`` would give the new version)."""
    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        r1 = push_dataset(write_built_dataset(tmp_path / "b1", make_rows(3)), REPO, "v1.0")
        short = r1.commit_sha[:7]
        api = HfApi()
        assert api.dataset_info(REPO, revision=short).sha == r1.commit_sha  # the Hub reads it as the commit
        before = hub.dump_state()
        with pytest.raises(VersionNameError, match=f"invalid version name '{short}': it is 7 or more hex digits: "
                                                   "it would read as a commit id"):
            push_dataset(write_built_dataset(tmp_path / "b2", make_rows(4, seed=2)), REPO, short)
        assert hub.dump_state() == before
        assert api.dataset_info(REPO, revision=short).sha == r1.commit_sha


@pytest.mark.parametrize("length", [129, 300])
def test_a_name_longer_than_the_limit_is_refused_saying_the_limit(length):
    name = "v" + "1" * (length - 1)
    assert version_name_problem("v" + "1" * (MAX_LENGTH - 1)) is None
    with pytest.raises(VersionNameError) as e:
        check_version_name(name)
    assert f"is {length} characters long: at most {MAX_LENGTH} are allowed" in str(e.value)
    assert name not in str(e.value) and f"{name[:40]!r}..." in str(e.value)  # quoted shortened, one line


def test_a_version_named_like_an_existing_branch_is_refused(tmp_path):
    build = write_built_dataset(tmp_path / "b", make_rows(3))
    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        api = HfApi()
        api.create_repo(REPO, repo_type="dataset")
        api.create_branch(REPO, repo_type="dataset", branch="dev")
        with pytest.raises(VersionNameError, match="existing branch"):
            push_dataset(build, REPO, "dev")
        refs = api.list_repo_refs(REPO, repo_type="dataset")
        assert refs.tags == [] and sorted(b.name for b in refs.branches) == ["dev", "main"]  # no orphan work branch


@pytest.mark.parametrize("rerun_force", [True, False])
def test_a_killed_force_push_resumes_into_the_version_it_replaced(tmp_path, rerun_force):
    """The push is SIGKILLed right after it deleted the old tag (the version is gone from the Hub):
    running it again re-creates the version on the new build, and the card records the force and the
    commit it replaced (also when rerun without --force: the card on the work branch says so)."""
    old, new = write_built_dataset(tmp_path / "old", make_rows(6)), write_built_dataset(tmp_path / "new", make_rows(7, seed=5))
    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        r1 = push_dataset(old, REPO, "v1.0")
        script = textwrap.dedent(f"""
            import os, signal
            from huggingface_hub import HfApi
            real = HfApi.create_tag
            def create_tag(self, *a, **k):
                os.kill(os.getpid(), signal.SIGKILL)  # after delete_tag: the tag is gone
            HfApi.create_tag = create_tag
            from hs_dataset.hub.publish import push_dataset
            push_dataset({str(new)!r}, {REPO!r}, "v1.0", force=True)
        """)
        run_killed_client(hub, tmp_path / "subhome", script, token=TOKEN)
        api = HfApi()
        refs = api.list_repo_refs(REPO, repo_type="dataset")
        assert refs.tags == [] and "hs-dataset/v1.0" in {b.name for b in refs.branches}  # the version vanished

        r2 = push_dataset(new, REPO, "v1.0", force=rerun_force)
        assert r2.forced and r2.previous_commit == r1.commit_sha and r2.resumed
        tags = {t.name: t.target_commit for t in api.list_repo_refs(REPO, repo_type="dataset").tags}
        assert tags == {"v1.0": r2.commit_sha}
        card = hub.read_file("dataset", REPO, "README.md", "v1.0").decode()
        history = parse_history(card)
        assert [(e["version"], e["force"]) for e in history] == [("v1.0", False), ("v1.0", True)]
        assert history[-1]["previous_commit"] == r1.commit_sha and "force-pushed" in card
        got = hub.files_at("dataset", REPO, "v1.0")
        assert got["rejects.jsonl"].sha256 and set(got) >= {"hs_dataset.json", "rejects.jsonl"}
        assert hub.read_file("dataset", REPO, "hs_dataset.json", "v1.0") == (new / "hs_dataset.json").read_bytes()
