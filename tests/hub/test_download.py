"""A published version is read from one copy on disk (issue 28): ``open_dataset("org/name", revision=...)``
downloads the version's files once into a folder of their own (real huggingface_hub over HTTP, the local
Hub), checks each downloaded shard's content hash, and maps them there; opened again, nothing is fetched.
Its disk use is measured beside what ``load_dataset`` costs for a local build and for the same version."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
import torch
from huggingface_hub import CommitOperationDelete, HfApi

from hs_dataset.errors import ConfigError, HubAccessError, IntegrityError, NotABuildError
from hs_dataset.hub.download import STALE_PARTIAL_S, default_version_dir, download_version
from hs_dataset.hub.publish import push_dataset
from hs_dataset.hub.verify_remote import verify_repo
from hs_dataset.hub.versions import list_versions
from hs_dataset.read import TORCH_FORMAT, iter_torch, open_dataset
from hs_dataset.read.shard_checks import CHECK_ENV
from tests.fakehub.tools import client_subprocess_env
from tests.fixtures.builds import random_build

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    from reads import disk_bytes  # the read benchmark's own count: blocks under the roots, each file once
finally:
    sys.path.pop(0)
REPO = "org/kimi-eagle3-hs"
TOKEN = "hf_DownloadTestToken0123456789ABCDEFGH"
PUBLISHED = ("hs_dataset.json", "README.md", "rejects.jsonl")


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """A 34 MB build of random states in 4 shards (8 samples of 512 tokens, H=1024, parts of 2)."""
    return random_build(tmp_path_factory.mktemp("download"), samples=8, tokens=512, hidden=1024, part_size=2)


@pytest.fixture(autouse=True)
def checks_on(monkeypatch):
    monkeypatch.delenv(CHECK_ENV, raising=False)  # the readers check every block, whatever the shell's setting


def version_bytes(build: Path) -> int:
    """The bytes of what a version holds: the shards and the three metadata files."""
    return sum(p.stat().st_size for p in (build / "data").iterdir()) + sum((build / n).stat().st_size for n in PUBLISHED)


def data_gets(hub) -> list[str]:
    return [path for method, path, status in hub.request_log if method == "GET" and "/resolve/" in path
            and "/data/" in path]


def rows_of(ds) -> list[dict]:
    return list(iter_torch(ds, batch_size=2))


def assert_same_rows(a: list[dict], b: list[dict]) -> None:
    assert [r["id"] for r in a] == [r["id"] for r in b] and len(a) == 8
    for x, y in zip(a, b):
        for k, v in x.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v.view(torch.uint8) if v.dtype == torch.bfloat16 else v,
                                   y[k].view(torch.uint8) if v.dtype == torch.bfloat16 else y[k]), k


def test_a_version_is_downloaded_once_and_mapped_in_place(hub, build, tmp_path):
    push_dataset(build, REPO, "v1.0")
    home = Path(os.environ["HF_HOME"])
    before = disk_bytes(home)
    ds = open_dataset(REPO, revision="v1.0")
    commit = HfApi().dataset_info(REPO, revision="v1.0").sha
    folder = default_version_dir(REPO, commit)
    assert sorted(Path(c["filename"]).resolve() for c in ds.cache_files) == \
        sorted(p.resolve() for p in (folder / "data").glob("*.arrow"))  # the downloaded files, mapped where they are
    assert_same_rows(rows_of(ds), rows_of(open_dataset(build)))
    gets = data_gets(hub)
    assert sorted(gets) == sorted(f"/datasets/{REPO}/resolve/{commit}/data/{p.name}" for p in (build / "data").iterdir())
    used = disk_bytes(home) - before
    ratio = used / version_bytes(build)
    print(f"open_dataset({REPO!r}, revision='v1.0'): {used} bytes on disk = {ratio:.4f}x the version")
    assert 1.0 <= ratio <= 1.05, ratio

    hub.request_log.clear()
    again = open_dataset(REPO, revision="v1.0")  # opened again: nothing downloaded, not even asked for
    assert len(again) == 8 and data_gets(hub) == [] and disk_bytes(home) - before == used
    assert not [p for m, p, s in hub.request_log if "/resolve/" in p]
    assert_same_rows(rows_of(again.with_format(TORCH_FORMAT)), rows_of(ds))

    stream = open_dataset(REPO, revision="v1.0", streaming=True)  # over HTTP: nothing written
    assert [r["id"] for r in stream] == list(ds["id"]) and disk_bytes(home) - before - used < 1 << 20


def test_what_each_way_of_training_costs_on_disk(hub, build):
    """One copy at most for open_dataset (a local build: none; a version: the download); load_dataset copies."""
    push_dataset(build, REPO, "v1.0")
    size, home = version_bytes(build), Path(os.environ["HF_HOME"])  # every cache of the client is under home
    costs: dict[str, float] = {}
    for name, fn in {"open_dataset(dir)": lambda: open_dataset(build),
                     "open_dataset(repo)": lambda: open_dataset(REPO, revision="v1.0"),
                     "load_dataset(dir)": lambda: datasets.load_dataset(str(build), split="train"),
                     "load_dataset(repo)": lambda: datasets.load_dataset(REPO, revision="v1.0", split="train")}.items():
        before = disk_bytes(home)
        assert len(fn()) == 8
        costs[name] = (disk_bytes(home) - before) / size
    print(json.dumps({k: round(v, 4) for k, v in costs.items()}))
    assert costs["open_dataset(dir)"] < 0.01 and 1.0 <= costs["open_dataset(repo)"] <= 1.05
    assert costs["load_dataset(dir)"] >= 0.95  # a second copy of the build, in the datasets cache
    assert costs["load_dataset(repo)"] >= 1.9  # the hub cache + the datasets cache


def flip_middle(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))


def test_a_shard_damaged_on_the_way_is_deleted_refused_and_fetched_again(hub, build, monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "0")  # the download is checked even so
    push_dataset(build, REPO, "v1.0")
    shard = sorted((build / "data").iterdir())[1]
    obj = next(p for p in hub.objects_dir.iterdir() if p.stat().st_size == shard.stat().st_size
               and p.read_bytes() == shard.read_bytes())
    good = obj.read_bytes()
    flip_middle(obj)  # the Hub serves damaged bytes (as a faulty transfer would), of the right size
    with pytest.raises(IntegrityError, match=f"data/{shard.name} as downloaded differs") as e:
        open_dataset(REPO, revision="v1.0")
    assert "open the version again" in str(e.value)
    commit = HfApi().dataset_info(REPO, revision="v1.0").sha
    local = default_version_dir(REPO, commit) / "data" / shard.name
    assert not local.exists()  # deleted: nothing damaged is left to be read
    obj.write_bytes(good)
    hub.request_log.clear()
    ds = open_dataset(REPO, revision="v1.0")
    assert data_gets(hub) == [f"/datasets/{REPO}/resolve/{commit}/data/{shard.name}"]  # that file only
    assert_same_rows(rows_of(ds), rows_of(open_dataset(build)))


def test_a_shard_damaged_on_disk_after_the_download_is_refused_by_the_readers(hub, build):
    push_dataset(build, REPO, "v1.0")
    ds = open_dataset(REPO, revision="v1.0")
    assert len(rows_of(ds)) == 8
    shard = Path(sorted(c["filename"] for c in ds.cache_files)[2])
    flip_middle(shard)
    hub.request_log.clear()
    with pytest.raises(IntegrityError, match="This is a downloaded version: delete .*open the version again"):
        rows_of(open_dataset(REPO, revision="v1.0"))
    assert data_gets(hub) == []
    shard.unlink()  # as the message says
    assert len(rows_of(open_dataset(REPO, revision="v1.0"))) == 8
    assert len(data_gets(hub)) == 1


def test_a_killed_download_resumes_at_the_files_it_had_not_finished(hub, build):
    push_dataset(build, REPO, "v1.0")
    open_dataset(REPO, revision="v1.0")
    folder = default_version_dir(REPO, HfApi().dataset_info(REPO, revision="v1.0").sha)
    shards = sorted((folder / "data").iterdir())
    for p in shards[2:]:  # as if killed after two shards: the others missing, one half written
        p.unlink()
    partial = folder / ".cache" / "huggingface" / "download" / "data" / f"{shards[2].name}.0123abcd.incomplete"
    partial.write_bytes(b"\0" * 4096)
    old = time.time() - STALE_PARTIAL_S - 60
    os.utime(partial, (old, old))
    hub.request_log.clear()
    assert len(open_dataset(REPO, revision="v1.0")) == 8
    assert sorted(p.rsplit("/", 1)[1] for p in data_gets(hub)) == [p.name for p in shards[2:]]
    assert not partial.exists()


def test_a_version_whose_files_differ_from_its_record_is_refused_before_any_shard_is_fetched(hub, build, tmp_path):
    push_dataset(build, REPO, "v1.0")
    api = HfApi()
    api.create_branch(REPO, repo_type="dataset", branch="missing", revision="v1.0")
    name = sorted((build / "data").iterdir())[1].name
    api.create_commit(REPO, [CommitOperationDelete(f"data/{name}")], repo_type="dataset", revision="missing",
                      commit_message="a shard lost")
    hub.request_log.clear()
    with pytest.raises(IntegrityError, match=f"data/{name} is missing.*Nothing of it was downloaded"):
        open_dataset(REPO, revision="missing", local_dir=tmp_path / "dl")
    with pytest.raises(IntegrityError, match=name):
        open_dataset(REPO, revision="missing", streaming=True)
    assert data_gets(hub) == []


def test_bad_names_are_one_line_each(hub, build, tmp_path, monkeypatch):
    push_dataset(build, REPO, "v1.0")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NotABuildError, match="demo_ot: no such build directory, nor a Hub repo id"):
        open_dataset("demo_ot")
    with pytest.raises(NotABuildError, match="nor a Hub repo id"):
        open_dataset("org/na me")
    with pytest.raises(HubAccessError, match=r"org/nope on .*not found \(404\).*nor is there a build directory org/nope"):
        open_dataset("org/nope")
    with pytest.raises(HubAccessError, match="no such version or revision"):
        open_dataset(REPO, revision="v9.9")
    with pytest.raises(ConfigError, match="revision='v1.0' is for a Hub repo"):
        open_dataset(build, revision="v1.0")


def test_the_cards_snippets_run_as_they_stand_against_the_version(hub, build, tmp_path):
    """The card's load and decode snippets (the fast path: open_dataset + iter_torch; the states as zero-copy
    views of the Arrow buffers, not Python lists), run in a fresh process against the published version."""
    push_dataset(build, REPO, "v1.0")
    card = hub.read_file("dataset", REPO, "README.md", "v1.0").decode()
    blocks = re.findall(r"```python\n(.*?)```", card, re.S)  # load, decode, then the many-nodes reader
    load, decode = blocks[0], next(b for b in blocks if "table[" in b)
    assert "tolist" not in decode and "np.asarray(ds[" not in decode and "iter_torch" in load
    column = re.search(r'table\["(hidden_[a-z_0-9]+)"\]', decode).group(1)
    script = tmp_path / "card.py"
    script.write_text(load + decode + f"assert torch.equal(hidden, row[{column!r}]) and hidden.dtype == torch.bfloat16\n"
                      "print('decoded', tuple(hidden.shape))\n")
    env = {**client_subprocess_env(hub, tmp_path / "sub", token=TOKEN), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "decoded (512, 1024)" in r.stdout


def test_streaming_from_the_hub_checks_every_block_before_its_rows(hub, build):
    """open_dataset(repo, streaming=True) hashes each 1 MiB block as it arrives (issue 48, finding 2)."""
    push_dataset(build, REPO, "v1.0")
    local = {r["id"]: r for r in rows_of(open_dataset(build))}
    streamed = rows_of(open_dataset(REPO, revision="v1.0", streaming=True))
    assert_same_rows(streamed, [local[r["id"]] for r in streamed])
    shard = sorted((build / "data").iterdir())[2]
    obj = next(p for p in hub.objects_dir.iterdir() if p.stat().st_size == shard.stat().st_size
               and p.read_bytes() == shard.read_bytes())
    flip_middle(obj)  # the Hub serves damaged bytes of the right size
    served = []
    with pytest.raises(IntegrityError, match=rf"data/{shard.name}: block \d+ .* as streamed differs"):
        for row in iter_torch(open_dataset(REPO, revision="v1.0", streaming=True), batch_size=1):
            served.append(row)
    assert 4 <= len(served) < 8  # the shards before it, then none of the damaged block's rows
    for r in served:
        for k, v in r.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v.view(torch.uint8), local[r["id"]][k].view(torch.uint8)), (r["id"], k)


def test_verify_then_open_keeps_one_copy_of_the_version(hub, build):
    """verify_repo downloads into the folder open_dataset maps (issue 48 finding 6, issue 50 item 3)."""
    push_dataset(build, REPO, "v1.0")
    home = Path(os.environ["HF_HOME"])
    before = disk_bytes(home)
    assert verify_repo(REPO, revision="v1.0").ok
    hub.request_log.clear()
    ds = open_dataset(REPO, revision="v1.0")
    assert data_gets(hub) == []  # nothing fetched again
    ratio = (disk_bytes(home) - before) / version_bytes(build)
    print(f"verify + open_dataset: {ratio:.4f}x the version on disk")
    assert 1.0 <= ratio <= 1.05, ratio
    assert len(rows_of(ds)) == 8


def test_hub_failures_are_the_projects_errors_in_the_library(hub, build):
    """One place maps Hub failures (hs_dataset.hub.access): every public Hub function raises HubAccessError."""
    push_dataset(build, REPO, "v1.0")
    with pytest.raises(HubAccessError, match=r"org/nope on .*not found \(404\)"):
        list_versions("org/nope")
    with pytest.raises(HubAccessError, match=r"not found \(404\)"):
        verify_repo("org/nope", revision="v1.0")
    with pytest.raises(HubAccessError, match="no such version or revision"):
        verify_repo(REPO, revision="v9.9", quick=True)
    with pytest.raises(HubAccessError, match=r"cannot reach http://127.0.0.1:9 "):
        push_dataset(build, REPO, "v1.1", endpoint="http://127.0.0.1:9")
    with pytest.raises(HubAccessError, match="not a Hub repo id"):
        download_version("org/na me")
