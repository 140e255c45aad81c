"""The local Hub server against the real huggingface_hub client and datasets.load_dataset."""

from __future__ import annotations

import os
import threading

import pytest

httpx2 = pytest.importorskip("httpx2", reason="huggingface_hub >= 2 (httpx2) needed for the Hub tests")
from huggingface_hub import (CommitOperationAdd, CommitOperationCopy, CommitOperationDelete, HfApi, HfFileSystem,
                             hf_hub_download)
from huggingface_hub.errors import (BadRequestError, EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError,
                                    RevisionNotFoundError)
from huggingface_hub.hf_api import RepoFile, RepoFolder

from tests.fakehub.server import DEFAULT_GITATTRIBUTES, git_blob_oid, is_lfs_path, lfs_patterns, running_hub
from tests.fakehub.tools import expected_table, hub_client_env, make_rows, write_built_dataset

TOKEN = "hf_serverTestToken0000000000000000"
REPO = "org/hs-test"


@pytest.fixture
def hub(tmp_path):
    with running_hub(tmp_path) as server, hub_client_env(server, tmp_path / "home", token=TOKEN):
        yield server


@pytest.fixture
def api(hub):
    return HfApi()  # endpoint + token come from the patched constants / HF_TOKEN


def _head(api: HfApi, rev: str = "main") -> str:
    return api.dataset_info(REPO, revision=rev).sha


def test_client_really_talks_to_the_local_server(hub, api):
    assert api.endpoint == hub.endpoint
    api.create_repo(REPO, repo_type="dataset")
    assert ("POST", "/api/repos/create", 200) in hub.request_log
    assert hub.auth_requests >= 1


def test_create_repo_conflict_and_info(hub, api):
    url = api.create_repo(REPO, repo_type="dataset")
    assert url.repo_id == REPO and url.repo_type == "dataset" and url.endpoint == hub.endpoint
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo(REPO, repo_type="dataset")
    assert err.value.response.status_code == 409
    assert api.create_repo(REPO, repo_type="dataset", exist_ok=True).repo_id == REPO
    info = api.dataset_info(REPO, files_metadata=True)
    assert [s.rfilename for s in info.siblings] == [".gitattributes"]
    assert info.siblings[0].size == len(DEFAULT_GITATTRIBUTES)
    assert len(info.sha) == 40 and info.private is False
    assert api.repo_exists(REPO, repo_type="dataset")
    assert not api.repo_exists("org/nope", repo_type="dataset")
    with pytest.raises(RepositoryNotFoundError):
        api.dataset_info("org/nope")
    with pytest.raises(RevisionNotFoundError):
        api.dataset_info(REPO, revision="no-such-branch")
    assert not api.revision_exists(REPO, "no-such-branch", repo_type="dataset")


def test_upload_folder_lfs_rules_dedupe_and_listing(hub, api, tmp_path):
    api.create_repo(REPO, repo_type="dataset")
    folder = tmp_path / "up"
    (folder / "data" / "deep").mkdir(parents=True)
    (folder / "data" / "a.arrow").write_bytes(b"arrow-bytes" * 10)  # small, but *.arrow is LFS-tracked
    (folder / "data" / "deep" / "b.parquet").write_bytes(b"PAR1" * 5)
    big = os.urandom(10 * 1024 * 1024)  # >= 10 MiB: LFS whatever its name
    (folder / "big.dat").write_bytes(big)
    (folder / "notes.txt").write_text("hello\n")
    api.upload_folder(folder_path=str(folder), repo_id=REPO, repo_type="dataset")

    files = hub.files_at("dataset", REPO)
    assert {p: e.lfs for p, e in files.items()} == {
        ".gitattributes": False, "data/a.arrow": True, "data/deep/b.parquet": True, "big.dat": True, "notes.txt": False,
    }
    assert sum(hub.lfs_uploads.values()) == 3 and set(hub.lfs_uploads.values()) == {1}
    assert hub.read_file("dataset", REPO, "big.dat") == big

    tree = list(api.list_repo_tree(REPO, repo_type="dataset", recursive=True))
    by_path = {e.path: e for e in tree}
    assert isinstance(by_path["data"], RepoFolder) and isinstance(by_path["data/deep"], RepoFolder)
    assert by_path["notes.txt"].blob_id == git_blob_oid(b"hello\n") and by_path["notes.txt"].lfs is None
    lfs = by_path["big.dat"].lfs
    assert lfs.size == len(big) and lfs.pointer_size > 100 and by_path["big.dat"].size == len(big)
    top = {e.path for e in api.list_repo_tree(REPO, repo_type="dataset")}
    assert top == {".gitattributes", "big.dat", "notes.txt", "data"}
    sub = {e.path for e in api.list_repo_tree(REPO, "data", repo_type="dataset")}
    assert sub == {"data/a.arrow", "data/deep"}
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree(REPO, "missing", repo_type="dataset"))

    # same folder again: preupload returns the remote oids, nothing changes, no new commit, no upload
    head = _head(api)
    api.upload_folder(folder_path=str(folder), repo_id=REPO, repo_type="dataset")
    assert _head(api) == head and sum(hub.lfs_uploads.values()) == 3
    # the same LFS content under another name: the batch API answers "already there" (no PUT)
    api.upload_file(path_or_fileobj=big, path_in_repo="copy/big.bin", repo_id=REPO, repo_type="dataset")
    assert sum(hub.lfs_uploads.values()) == 3
    assert hub.files_at("dataset", REPO)["copy/big.bin"].lfs


def test_tree_pagination_paths_info_and_commits(hub, api):
    api.create_repo(REPO, repo_type="dataset")
    hub.tree_page_size = 3
    ops = [CommitOperationAdd(f"f/{i:02d}.txt", f"{i}\n".encode()) for i in range(10)]
    api.create_commit(REPO, ops, repo_type="dataset", commit_message="ten files")
    tree = list(api.list_repo_tree(REPO, repo_type="dataset", recursive=True))
    assert sorted(e.path for e in tree if isinstance(e, RepoFile)) == [".gitattributes"] + [f"f/{i:02d}.txt" for i in range(10)]
    assert sum(1 for m, p, s in hub.request_log if p.endswith("/tree/main")) >= 4  # followed the Link header
    expanded = list(api.list_repo_tree(REPO, "f", repo_type="dataset", expand=True))
    assert all(e.last_commit is not None and e.last_commit.title == "ten files" for e in expanded)

    infos = api.get_paths_info(REPO, ["f", "f/03.txt", "nope.txt"], repo_type="dataset")
    assert [(type(i).__name__, i.path) for i in infos] == [("RepoFolder", "f"), ("RepoFile", "f/03.txt")]
    commits = api.list_repo_commits(REPO, repo_type="dataset")
    assert [c.title for c in commits] == ["ten files", "initial commit"]
    assert api.list_repo_files(REPO, repo_type="dataset")[:2] == [".gitattributes", "f/00.txt"]


def test_tags_branches_and_downloads_by_revision(hub, api, tmp_path):
    api.create_repo(REPO, repo_type="dataset")
    v1 = api.create_commit(REPO, [CommitOperationAdd("x.txt", b"one\n")], repo_type="dataset",
                           commit_message="v1").oid
    api.create_tag(REPO, tag="v1.0", repo_type="dataset", tag_message="first")
    with pytest.raises(HfHubHTTPError) as err:
        api.create_tag(REPO, tag="v1.0", repo_type="dataset")
    assert err.value.response.status_code == 409
    api.create_tag(REPO, tag="v1.0", repo_type="dataset", exist_ok=True)
    api.create_commit(REPO, [CommitOperationAdd("x.txt", b"two\n")], repo_type="dataset", commit_message="v2")

    # a branch whose name has a slash, starting from the tag
    api.create_branch(REPO, branch="hs-dataset/v1.1", revision="v1.0", repo_type="dataset")
    with pytest.raises(HfHubHTTPError) as err:
        api.create_branch(REPO, branch="hs-dataset/v1.1", repo_type="dataset")
    assert err.value.response.status_code == 409
    api.create_branch(REPO, branch="hs-dataset/v1.1", repo_type="dataset", exist_ok=True)
    with pytest.raises(BadRequestError):
        api.create_branch(REPO, branch="refs/pr/5", repo_type="dataset")
    api.create_commit(REPO, [CommitOperationAdd("x.txt", b"three\n")], repo_type="dataset",
                      revision="hs-dataset/v1.1", commit_message="on branch")

    def read(rev):
        return open(hf_hub_download(REPO, "x.txt", repo_type="dataset", revision=rev), "rb").read()

    assert read("v1.0") == b"one\n" and read(v1) == b"one\n" and read(v1[:7]) == b"one\n"
    assert read("main") == b"two\n" and read("hs-dataset/v1.1") == b"three\n"
    assert read("refs/tags/v1.0") == b"one\n" and read("refs/heads/hs-dataset/v1.1") == b"three\n"
    assert api.dataset_info(REPO, revision="v1.0").sha == v1  # the tag did not move with main
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "missing.txt", repo_type="dataset", revision="v1.0")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "x.txt", repo_type="dataset", revision="v9")

    snap = api.snapshot_download(REPO, repo_type="dataset", revision="v1.0", local_dir=str(tmp_path / "snap"))
    assert sorted(p.name for p in (tmp_path / "snap").iterdir() if p.is_file()) == [".gitattributes", "x.txt"]
    assert (tmp_path / "snap" / "x.txt").read_bytes() == b"one\n" and snap == str(tmp_path / "snap")
    assert api.file_exists(REPO, "x.txt", repo_type="dataset", revision="hs-dataset/v1.1")
    assert not api.file_exists(REPO, "y.txt", repo_type="dataset", revision="hs-dataset/v1.1")

    refs = api.list_repo_refs(REPO, repo_type="dataset")
    assert {b.name for b in refs.branches} == {"main", "hs-dataset/v1.1"}
    assert [(t.name, t.ref, t.target_commit) for t in refs.tags] == [("v1.0", "refs/tags/v1.0", v1)]
    assert refs.converts == []

    api.delete_tag(REPO, tag="v1.0", repo_type="dataset")
    with pytest.raises(RevisionNotFoundError):
        api.delete_tag(REPO, tag="v1.0", repo_type="dataset")
    api.delete_branch(REPO, branch="hs-dataset/v1.1", repo_type="dataset")
    with pytest.raises(HfHubHTTPError):
        api.delete_branch(REPO, branch="main", repo_type="dataset")
    refs = api.list_repo_refs(REPO, repo_type="dataset")
    assert [b.name for b in refs.branches] == ["main"] and refs.tags == []


def test_commit_semantics_parent_copy_delete_pr(hub, api):
    api.create_repo(REPO, repo_type="dataset")
    c1 = api.create_commit(REPO, [CommitOperationAdd("a.txt", b"a\n"), CommitOperationAdd("d/b.bin", b"\x00b" * 9),
                                  CommitOperationAdd("d/c.bin", b"\x00c" * 9)],
                           repo_type="dataset", commit_message="c1").oid
    with pytest.raises(HfHubHTTPError) as err:  # parent is not the head any more
        api.create_commit(REPO, [CommitOperationAdd("a.txt", b"x\n")], repo_type="dataset",
                          commit_message="stale", parent_commit=api.list_repo_commits(REPO, repo_type="dataset")[1].commit_id)
    assert err.value.response.status_code == 412
    c2 = api.create_commit(
        REPO,
        [CommitOperationCopy("d/b.bin", "e/b-copy.bin", src_revision=c1), CommitOperationCopy("a.txt", "a2.txt"),
         CommitOperationDelete("d/c.bin")],
        repo_type="dataset", commit_message="copy+delete", parent_commit=c1,
    ).oid
    files = hub.files_at("dataset", REPO)
    assert set(files) == {".gitattributes", "a.txt", "a2.txt", "d/b.bin", "e/b-copy.bin"}
    assert files["e/b-copy.bin"] == files["d/b.bin"] and files["e/b-copy.bin"].lfs
    with pytest.raises(EntryNotFoundError):
        api.create_commit(REPO, [CommitOperationDelete("nope.txt")], repo_type="dataset", commit_message="x")
    api.delete_folder("d", repo_id=REPO, repo_type="dataset")
    assert "d/b.bin" not in hub.files_at("dataset", REPO)

    pr = api.create_commit(REPO, [CommitOperationAdd("pr.txt", b"pr\n")], repo_type="dataset",
                           commit_message="a PR", create_pr=True)
    assert pr.pr_url.endswith("/discussions/1") and pr.pr_revision == "refs/pr/1"
    assert open(hf_hub_download(REPO, "pr.txt", repo_type="dataset", revision="refs/pr/1"), "rb").read() == b"pr\n"
    assert "pr.txt" not in hub.files_at("dataset", REPO)
    assert "pr.txt" in {e.path for e in api.list_repo_tree(REPO, repo_type="dataset", revision="refs/pr/1")}
    assert api.get_paths_info(REPO, "pr.txt", repo_type="dataset", revision="refs/pr/1")[0].size == 3
    refs = api.list_repo_refs(REPO, repo_type="dataset", include_pull_requests=True)
    assert [p.ref for p in refs.pull_requests] == ["refs/pr/1"]
    assert hub.commit_of("dataset", REPO, "refs/pr/1").parents == (api.dataset_info(REPO).sha,)
    assert api.dataset_info(REPO, revision=c2).sha == c2


def test_resolve_headers_and_ranges(hub, api):
    api.create_repo(REPO, repo_type="dataset")
    payload = bytes(range(256)) * 40
    api.upload_file(path_or_fileobj=payload, path_in_repo="blob.bin", repo_id=REPO, repo_type="dataset")
    api.upload_file(path_or_fileobj=b"plain text\n", path_in_repo="t.txt", repo_id=REPO, repo_type="dataset")
    sha = api.dataset_info(REPO).sha
    url = f"{hub.endpoint}/datasets/{REPO}/resolve/main/blob.bin"
    head = httpx2.head(url)
    assert head.status_code == 200 and head.headers["X-Repo-Commit"] == sha
    assert int(head.headers["X-Linked-Size"]) == len(payload) == int(head.headers["Content-Length"])
    meta = api.get_hf_file_metadata(url=url)
    assert meta.commit_hash == sha and meta.size == len(payload) and len(meta.etag) == 64
    meta_txt = api.get_hf_file_metadata(url=f"{hub.endpoint}/datasets/{REPO}/resolve/main/t.txt")
    assert meta_txt.etag == git_blob_oid(b"plain text\n")
    r = httpx2.get(url, headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == payload[10:20]
    assert r.headers["Content-Range"] == f"bytes 10-19/{len(payload)}"
    assert httpx2.get(url, headers={"Range": "bytes=-5"}).content == payload[-5:]
    assert httpx2.get(url, headers={"Range": f"bytes={len(payload) - 3}-"}).content == payload[-3:]
    assert httpx2.get(url, headers={"Range": f"bytes={len(payload)}-"}).status_code == 416
    missing = httpx2.head(f"{hub.endpoint}/datasets/{REPO}/resolve/main/none.bin")
    assert missing.status_code == 404 and missing.headers["X-Error-Code"] == "EntryNotFound"

    fs = HfFileSystem()
    with fs.open(f"datasets/{REPO}@main/blob.bin", "rb", block_size=64) as f:
        f.seek(1000)
        assert f.read(300) == payload[1000:1300]
    assert fs.info(f"datasets/{REPO}/blob.bin")["size"] == len(payload)
    assert sorted(fs.ls(f"datasets/{REPO}", detail=False)) == [f"datasets/{REPO}/{n}" for n in
                                                               (".gitattributes", "blob.bin", "t.txt")]


def test_load_dataset_by_revision_map_style_and_streaming(hub, api, tmp_path):
    import datasets

    api.create_repo(REPO, repo_type="dataset")
    rows_a, rows_b = make_rows(12, seed=1), make_rows(17, seed=2)
    for tag, rows in (("v1.0", rows_a), ("v2.0", rows_b)):
        build = write_built_dataset(tmp_path / tag, rows, shard_rows=5)
        api.upload_folder(folder_path=str(build), repo_id=REPO, repo_type="dataset", ignore_patterns=[".hs_build/*"],
                          delete_patterns=["data/*"])
        api.create_tag(REPO, tag=tag, repo_type="dataset")
    for tag, rows in (("v1.0", rows_a), ("v2.0", rows_b), (None, rows_b)):
        ds = datasets.load_dataset(REPO, revision=tag, split="train", cache_dir=str(tmp_path / "cache"))
        assert ds.data.table.equals(expected_table(rows)), tag
        streamed = list(datasets.load_dataset(REPO, revision=tag, split="train", streaming=True))
        assert [r["id"] for r in streamed] == [r["id"] for r in rows]
        assert all(s["hidden_layer_31"] == r["hidden_layer_31"].tolist() for s, r in zip(streamed, rows))
    assert any(s == 206 for _, p, s in hub.request_log if p.endswith(".arrow"))  # streaming used ranges


def test_write_token_is_enforced_and_never_stored(tmp_path):
    secret = "hf_writeOnlySecret1111111111111111"
    with running_hub(tmp_path, write_token=secret) as hub:
        with hub_client_env(hub, tmp_path / "anon"):
            with pytest.raises(HfHubHTTPError) as err:
                HfApi().create_repo(REPO, repo_type="dataset")
            assert err.value.response.status_code == 401
        with hub_client_env(hub, tmp_path / "auth", token=secret):
            HfApi().create_repo(REPO, repo_type="dataset", private=True)
            HfApi().upload_file(path_or_fileobj=b"x" * 100, path_in_repo="d.arrow", repo_id=REPO, repo_type="dataset")
            assert HfApi().dataset_info(REPO).private is True
        with hub_client_env(hub, tmp_path / "anon2"):
            with pytest.raises(RepositoryNotFoundError):
                HfApi().dataset_info(REPO)
        for path in hub.root.rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes()
        assert secret not in repr(hub.dump_state()) and secret not in repr(hub.request_log)


def test_gitattributes_rules():
    rules = lfs_patterns(DEFAULT_GITATTRIBUTES + "data/raw/** filter=lfs\n*.keep -filter\n")
    assert is_lfs_path(rules, "data/train-00000-00001.arrow")
    assert is_lfs_path(rules, "model.safetensors") and is_lfs_path(rules, "x.tar.gz")
    assert is_lfs_path(rules, "saved_model/a/b") and not is_lfs_path(rules, "saved_model")
    assert is_lfs_path(rules, "data/raw/x/y.txt") and not is_lfs_path(rules, "data/rawx.txt")
    assert not is_lfs_path(rules, "README.md") and not is_lfs_path(rules, "hs_dataset.json")
    assert not is_lfs_path(rules, "a.keep")


def test_server_stops_cleanly(tmp_path):
    with running_hub(tmp_path) as hub:
        endpoint = hub.endpoint
        assert httpx2.get(f"{endpoint}/api/datasets/none/none").status_code == 404
    with pytest.raises(httpx2.ConnectError):
        httpx2.get(f"{endpoint}/api/datasets/none/none", timeout=2)
    assert not any(t.name == "hub-server" and t.is_alive() for t in threading.enumerate())
