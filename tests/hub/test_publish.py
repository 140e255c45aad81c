"""Versioned publishing (hs_dataset.hub.publish) against the local Hub server: no network."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from hs_dataset.write.card import parse_history, render_card, split_readme
from hs_dataset.errors import HubAccessError, NotABuildError, PublishError, VersionExistsError
from hs_dataset.hub.publish import push_dataset
from hs_dataset.hub.versions import list_versions, version_key
from tests.fakehub.server import running_hub
from tests.fakehub.tools import (build_with_real_builder, client_subprocess_env, expected_table, hub_client_env,
                                 make_rows, run_killed_client, write_built_dataset)

ROOT = Path(__file__).resolve().parents[2]
REPO = "org/kimi-eagle3-hs"
TOKEN = "hf_PublishTestSecret0123456789ABCDEFGH"


def manifest(build: Path) -> dict[str, str]:
    """{path: sha256} of what a version of ``build`` must hold (README.md is re-rendered, so excluded)."""
    out = {}
    for p in sorted(build.rglob("*")):
        rel = p.relative_to(build).as_posix()
        if p.is_file() and not rel.startswith(".hs_build/") and rel != "README.md":
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def remote_manifest(hub, rev: str) -> dict[str, str]:
    return {p: e.sha256 for p, e in hub.files_at("dataset", REPO, rev).items() if p not in ("README.md", ".gitattributes")}


def load(rev, cache, streaming=False):
    import datasets

    return datasets.load_dataset(REPO, revision=rev, split="train", streaming=streaming, cache_dir=str(cache))


def assert_rows(rev, rows, cache):
    ds = load(rev, cache)
    assert ds.data.table.equals(expected_table(rows)), rev  # bit-identical columns
    streamed = list(load(rev, cache, streaming=True))
    assert [r["id"] for r in streamed] == [r["id"] for r in rows]
    for got, want in zip(streamed, rows):
        for layer in (3, 31, 59):
            assert got[f"hidden_layer_{layer}"] == want[f"hidden_layer_{layer}"].tolist()
        assert got["input_ids"] == want["input_ids"]


def test_versions_are_pinned_and_main_is_newest(hub, tmp_path):
    rows1 = make_rows(20)
    rows2 = rows1 + make_rows(9, start=20)  # "add rows": v1.1 = v1.0 + 9 samples, resharded
    b1 = write_built_dataset(tmp_path / "b1", rows1, shard_rows=8)
    b2 = write_built_dataset(tmp_path / "b2", rows2, shard_rows=8)

    r1 = push_dataset(b1, REPO, "v1.0", commit_files=2)
    assert r1.commit_sha and not r1.forced and r1.main_updated
    assert len(r1.commits) == 4  # 5 files in parts of 2, then the card
    assert sorted(hub.lfs_uploads.values()) == [1, 1, 1]
    r2 = push_dataset(b2, REPO, "v1.1", commit_files=2)
    assert r2.skipped == ["rejects.jsonl"]  # same path, same content: not even committed again
    # the first two v1.1 shards are byte-identical to v1.0's (renamed): their LFS content is not re-sent
    assert sorted(hub.lfs_uploads.values()) == [1] * 5
    assert r2.deleted == ["data/train-00000-00003.arrow", "data/train-00001-00003.arrow",
                          "data/train-00002-00003.arrow"]

    # each tag holds exactly its own files; main carries the newest version
    assert remote_manifest(hub, "v1.0") == manifest(b1)
    assert remote_manifest(hub, "v1.1") == manifest(b2)
    assert remote_manifest(hub, "main") == manifest(b2)
    refs = HfApi().list_repo_refs(REPO, repo_type="dataset")
    assert {t.name: t.target_commit for t in refs.tags} == {"v1.0": r1.commit_sha, "v1.1": r2.commit_sha}
    assert [b.name for b in refs.branches] == ["main"]  # work branches cleaned up

    cache = tmp_path / "dcache"
    assert_rows("v1.0", rows1, cache)
    assert_rows("v1.1", rows2, cache)
    assert_rows(None, rows2, cache)

    # the card keeps the build's YAML header byte for byte and records provenance + history
    card = hub.read_file("dataset", REPO, "README.md", "v1.1").decode()
    assert split_readme(card)[0] == split_readme((b2 / "README.md").read_text())[0]
    for needle in ("/models/tiny-llama", "0123456789abcdef0123456789abcdef01234567", "LlamaForCausalLM",
                   "3, 31, 59", "output of decoder layer i", "bfloat16", "view(torch.bfloat16)", "ab" * 32,
                   "2048", "30 / 29 / 1", "sglang", "`2.13.0`", "hs-dataset build --model", "v1.0", r1.commit_sha):
        assert needle in card, needle
    assert [e["version"] for e in parse_history(card)] == ["v1.0", "v1.1"]

    versions = list_versions(REPO)
    assert [(v.version, v.commit_sha, v.samples, v.tokens, v.rejected) for v in versions] == [
        ("v1.0", r1.commit_sha, 20, sum(len(r["input_ids"]) for r in rows1), 1),
        ("v1.1", r2.commit_sha, 29, sum(len(r["input_ids"]) for r in rows2), 1),
    ]


def test_repush_is_refused_and_force_is_recorded(hub, tmp_path):
    rows = make_rows(10)
    fixed = make_rows(11, seed=7)
    b1 = write_built_dataset(tmp_path / "b1", rows)
    r1 = push_dataset(b1, REPO, "v1.0")
    r2 = push_dataset(write_built_dataset(tmp_path / "b2", make_rows(12, seed=3)), REPO, "v1.1")
    before = hub.dump_state()

    bfix = write_built_dataset(tmp_path / "bfix", fixed)
    with pytest.raises(VersionExistsError) as err:
        push_dataset(bfix, REPO, "v1.0")
    assert "'v1.0'" in str(err.value) and "--force" in str(err.value)
    assert hub.dump_state() == before  # refused before touching anything
    same = push_dataset(b1, REPO, "v1.0")  # the build v1.0 holds: already there, not refused
    assert same.already_there and same.commit_sha == r1.commit_sha and not same.main_updated
    assert hub.dump_state() == before

    r3 = push_dataset(bfix, REPO, "v1.0", force=True)
    assert r3.forced and r3.previous_commit == r1.commit_sha and r3.commit_sha != r1.commit_sha
    assert not r3.main_updated  # v1.1 is newer: main stays on it
    assert remote_manifest(hub, "v1.0") == manifest(bfix)
    assert remote_manifest(hub, "main") == remote_manifest(hub, r2.commit_sha)
    assert hub.commit_of("dataset", REPO, r1.commit_sha).files  # the old commit is still addressable

    card = hub.read_file("dataset", REPO, "README.md", "v1.0").decode()
    forced = [e for e in parse_history(card) if e.get("force")]
    assert forced == [{"version": "v1.0", "force": True, "previous_commit": r1.commit_sha,
                       "pushed_at": forced[0]["pushed_at"]}]
    assert "force-pushed" in card and r1.commit_sha in card and forced[0]["pushed_at"] in card
    cache = tmp_path / "dcache"
    assert_rows("v1.0", fixed, cache)
    assert_rows(r1.commit_sha, rows, cache)  # what v1.0 was before, by sha
    # the force entry is carried forward by the next version's card
    r4 = push_dataset(write_built_dataset(tmp_path / "b3", make_rows(5, seed=4)), REPO, "v1.2")
    assert r4.main_updated
    card = hub.read_file("dataset", REPO, "README.md", "main").decode()
    assert [e["version"] for e in parse_history(card)] == ["v1.0", "v1.1", "v1.0", "v1.2"]
    assert r1.commit_sha in card


def _assert_tags_complete(hub, expected: dict[str, dict[str, str]]):
    assert hub.tag_events, "no tag was created"
    for event in hub.tag_events:
        files = {p: s for p, s in event["files"].items() if p not in ("README.md", ".gitattributes")}
        assert files == expected[event["tag"]], f"tag {event['tag']} pointed at partial data"


def test_interrupted_push_resumes_without_reuploading(hub, tmp_path):
    rows = make_rows(40)
    build = write_built_dataset(tmp_path / "b", rows, shard_rows=5)  # 8 shards + 2 small files
    lfs_files = sorted(p for p in manifest(build) if p.endswith(".arrow"))
    hub.fail_commit_requests = {3: 500}  # the 3rd commit request fails (2 parts already landed)
    with pytest.raises(HubAccessError, match="answered 500"):
        push_dataset(build, REPO, "v1.0", commit_files=3)
    refs = HfApi().list_repo_refs(REPO, repo_type="dataset")
    assert refs.tags == []  # nothing tagged
    partial = hub.files_at("dataset", REPO, "hs-dataset/v1.0")
    assert 0 < len([p for p in partial if p.endswith(".arrow")]) < len(lfs_files)
    assert set(hub.files_at("dataset", REPO, "main")) == {".gitattributes"}  # main untouched
    uploads_after_first_run = sum(hub.lfs_uploads.values())

    result = push_dataset(build, REPO, "v1.0", commit_files=3)
    assert result.resumed
    assert set(result.skipped) == {p for p in partial if p != ".gitattributes"}
    assert not set(result.uploaded) & set(result.skipped)
    assert remote_manifest(hub, "v1.0") == manifest(build) == remote_manifest(hub, "main")
    # every LFS object went over the wire exactly once, over both runs
    assert sorted(hub.lfs_uploads.values()) == [1] * len(lfs_files)
    assert uploads_after_first_run <= len(lfs_files)
    _assert_tags_complete(hub, {"v1.0": manifest(build)})
    assert_rows("v1.0", rows, tmp_path / "dcache")


def test_killed_push_process_resumes(hub, tmp_path):
    rows = make_rows(24)
    build = write_built_dataset(tmp_path / "b", rows, shard_rows=4)  # 6 shards
    hub.hold_commit_requests = {2}  # the 2nd commit hangs: the process is killed while waiting on it
    script = textwrap.dedent(f"""
        from hs_dataset.hub.publish import push_dataset
        push_dataset({str(build)!r}, {REPO!r}, "v2.0", commit_files=2)
        print("push finished")
    """)
    env = client_subprocess_env(hub, tmp_path / "subhome", token=TOKEN)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=str(ROOT), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert hub.held.wait(timeout=120), proc.communicate(timeout=5)[0].decode()[-3000:]
        landed = hub.files_at("dataset", REPO, "hs-dataset/v2.0")
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    finally:
        hub.release.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL and b"push finished" not in out
    assert len([p for p in landed if p.endswith(".arrow")]) == 2  # first part landed, second was in flight
    assert HfApi().list_repo_refs(REPO, repo_type="dataset").tags == []

    hub.hold_commit_requests = set()
    result = push_dataset(build, REPO, "v2.0", commit_files=2)
    assert result.resumed and set(landed) - {".gitattributes"} <= set(result.skipped)
    assert sorted(hub.lfs_uploads.values()) == [1] * 6  # the killed run's uploads were reused
    _assert_tags_complete(hub, {"v2.0": manifest(build)})
    assert_rows("v2.0", rows, tmp_path / "dcache")


def test_push_stopped_after_tagging_is_finished_by_a_rerun(hub, tmp_path):
    build = write_built_dataset(tmp_path / "b", make_rows(6))
    hub.commit_fault = lambda repo, rev, n: 503 if rev == "main" else None  # main's update fails
    with pytest.raises(HubAccessError):
        push_dataset(build, REPO, "v1.0")
    refs = HfApi().list_repo_refs(REPO, repo_type="dataset")
    assert [t.name for t in refs.tags] == ["v1.0"] and "hs-dataset/v1.0" in {b.name for b in refs.branches}
    hub.commit_fault = None
    result = push_dataset(build, REPO, "v1.0")  # no --force needed: same build, push not finished
    assert result.main_updated and not result.forced and result.already_there and result.resumed
    assert remote_manifest(hub, "main") == manifest(build)
    assert [b.name for b in HfApi().list_repo_refs(REPO, repo_type="dataset").branches] == ["main"]
    before = hub.dump_state()
    again = push_dataset(build, REPO, "v1.0")  # now it is finished: a rerun changes nothing
    assert again.already_there and not again.resumed and again.commit_sha == result.commit_sha
    assert hub.dump_state() == before
    with pytest.raises(VersionExistsError, match="holds other files than this build"):  # another build: refused
        push_dataset(write_built_dataset(tmp_path / "other", make_rows(6, seed=9)), REPO, "v1.0")


@pytest.mark.parametrize("killed_after", ["create_tag", "delete_branch"])
def test_a_push_killed_after_tagging_or_after_it_finished_reruns_without_force(hub, tmp_path, killed_after):
    """SIGKILLed right after the tag was made (main not updated yet) or after the last step (the caller
    never heard back): the same push run again, without --force, is done (nothing uploaded), having
    finished what was left; another build for the same version is still refused."""
    build = write_built_dataset(tmp_path / "b", make_rows(9), shard_rows=4)
    script = textwrap.dedent(f"""
        import os, signal
        from huggingface_hub import HfApi
        real = HfApi.{killed_after}
        def killed(self, *a, **k):
            real(self, *a, **k)
            os.kill(os.getpid(), signal.SIGKILL)  # the step was done; the process never returns
        HfApi.{killed_after} = killed
        from hs_dataset.hub.publish import push_dataset
        push_dataset({str(build)!r}, {REPO!r}, "v1.0")
    """)
    run_killed_client(hub, tmp_path / "subhome", script, token=TOKEN)
    api = HfApi()
    refs = api.list_repo_refs(REPO, repo_type="dataset")
    (tag,) = refs.tags
    assert tag.name == "v1.0" and remote_manifest(hub, "v1.0") == manifest(build)
    assert ("hs-dataset/v1.0" in {b.name for b in refs.branches}) == (killed_after == "create_tag")
    before = hub.dump_state()
    uploads = dict(hub.lfs_uploads)

    r = push_dataset(build, REPO, "v1.0")
    assert r.already_there and not r.forced and r.commit_sha == tag.target_commit
    assert r.uploaded == [] and r.commits == [] and hub.lfs_uploads == uploads
    assert r.resumed == (killed_after == "create_tag")  # what the killed push left is finished
    refs = api.list_repo_refs(REPO, repo_type="dataset")
    assert [(t.name, t.target_commit) for t in refs.tags] == [("v1.0", tag.target_commit)]
    assert [b.name for b in refs.branches] == ["main"] and remote_manifest(hub, "main") == manifest(build)
    if killed_after == "delete_branch":
        assert hub.dump_state() == before  # it had finished: the rerun changed nothing
    with pytest.raises(VersionExistsError, match="--force"):
        push_dataset(write_built_dataset(tmp_path / "other", make_rows(9, seed=4)), REPO, "v1.0")


@pytest.fixture
def hub_debug_logging():
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.DEBUG)
    yield
    hub_logger.setLevel(level)


def test_token_is_never_written_printed_or_logged(tmp_path, capfd, caplog, hub_debug_logging):
    caplog.set_level(logging.DEBUG)
    build = write_built_dataset(tmp_path / "b", make_rows(6))
    with running_hub(tmp_path, write_token=TOKEN) as hub, hub_client_env(hub, tmp_path / "home", token=TOKEN):
        assert os.environ["HF_TOKEN"] == TOKEN
        push_dataset(build, REPO, "v1.0", build_command=f"hs-dataset build --hf-token {TOKEN} --out x")
        list_versions(REPO)
        load("v1.0", tmp_path / "dcache")
        card = hub.read_file("dataset", REPO, "README.md", "v1.0").decode()
        state = json.dumps(hub.dump_state()) + repr(hub.request_log)
        assert hub.auth_requests > 0  # the token was really sent (and required: write_token)

        # a build whose metadata embeds the token is refused before anything is uploaded
        leaky = write_built_dataset(tmp_path / "leaky", make_rows(3),
                                    extra_metadata={"build_command": f"HF_TOKEN={TOKEN} hs-dataset build"})
        with pytest.raises(PublishError, match="contains your Hugging Face token") as err:
            push_dataset(leaky, REPO, "v1.1")
        assert TOKEN not in str(err.value)
        leaky_files = {tmp_path / "leaky" / "hs_dataset.json"}
    out, errs = capfd.readouterr()
    assert "hf-token ***" in card and "hs-dataset build" in card
    for text in (card, state, out, errs, caplog.text):
        assert TOKEN not in text
    scanned = 0
    for path in tmp_path.rglob("*"):  # local build, server storage, HF + datasets caches
        if path.is_file() and path not in leaky_files:
            scanned += 1
            assert TOKEN.encode() not in path.read_bytes(), path
    assert scanned > 20


def test_clear_errors_for_unfinished_builds_and_bad_versions(tmp_path):
    build = write_built_dataset(tmp_path / "b", make_rows(3))
    (build / "hs_dataset.json").unlink()
    with pytest.raises(NotABuildError, match="hs_dataset.json"):
        push_dataset(build, REPO, "v1.0")
    with pytest.raises(NotABuildError, match="no such build directory"):
        push_dataset(tmp_path / "nope", REPO, "v1.0")
    build2 = write_built_dataset(tmp_path / "b2", make_rows(3))
    (build2 / "README.md").unlink()
    with pytest.raises(NotABuildError, match="README.md"):
        push_dataset(build2, REPO, "v1.0")
    for bad in ("", "v1 0", "v1..0", "-v1", "refs/tags/v1", "v1.0.lock", "v1:0"):
        with pytest.raises(PublishError, match="invalid version"):
            push_dataset(tmp_path / "b2", REPO, bad)


def test_render_card_keeps_header_and_handles_missing_fields():
    header = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*.arrow\n" \
             "dataset_info:\n  features:\n  - name: id\n    dtype: string\n---\n"
    card = render_card({"model": {"path": "m|x"}, "counts": {"written": 3}},
                       {"readme": header + "\nold body\n", "repo_id": "o/r", "version": "v0.1",
                        "history": [{"version": "v0.1", "pushed_at": "2025-01-01T00:00:00Z", "force": False}]})
    assert card.startswith(header) and "old body" not in card
    assert "m\\|x" in card and "n/a" in card and 'revision="v0.1"' in card
    assert parse_history(card) == [{"version": "v0.1", "pushed_at": "2025-01-01T00:00:00Z", "force": False}]
    bare = render_card({}, {})
    assert split_readme(bare)[0].startswith("---\nconfigs:") and "data/train-*.arrow" in bare
    assert version_key("v1.10") > version_key("v1.9") > version_key("v1.9rc1") > version_key("latest")


def test_end_to_end_with_the_real_builder(hub, tmp_path):
    import datasets

    build = build_with_real_builder(tmp_path / "real", max_samples=12)
    result = push_dataset(build, REPO, "v0.1")
    assert remote_manifest(hub, "v0.1") == manifest(build)
    local = datasets.load_dataset(str(build), split="train")
    remote = load("v0.1", tmp_path / "dcache")
    assert remote.data.table.equals(local.data.table)
    card = hub.read_file("dataset", REPO, "README.md", result.commit_sha).decode()
    meta = json.loads((build / "hs_dataset.json").read_text())
    assert split_readme(card)[0] == split_readme((build / "README.md").read_text())[0]
    assert meta["model"]["architecture"] in card and meta["tokenizer"]["chat_template_sha256"] in card
    assert [v.samples for v in list_versions(REPO)] == [meta["counts"]["written"]]
