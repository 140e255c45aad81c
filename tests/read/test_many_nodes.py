"""Training on many nodes from one published version, on the local test Hub (real huggingface_hub over HTTP) and a
local S3 server (moto, real s3fs): every row of an epoch read once over all ranks, in one order whatever the
node layout, each node fetching only its ranks' shards into a cache smaller than the version; a mid-epoch state
resumed at another world size; a damaged stored shard refused by name on every path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hs_dataset.cli import main as cli_main
from hs_dataset.errors import IntegrityError, VersionExistsError
from hs_dataset.hub.object_push import push_objects
from hs_dataset.hub.objects import list_object_versions, verify_object_version
from hs_dataset.hub.publish import push_dataset
from hs_dataset.hub.verify_remote import verify_repo
from hs_dataset.read import iter_torch, open_dataset
from hs_dataset.read.ranked import open_ranked
from hs_dataset.read.shard_checks import CHECK_ENV
from hs_dataset.write.shard_sizing import fetch_factor
from tests.fakehub.tools import client_subprocess_env
from tests.fixtures.builds import random_build, root_env
from tests.fixtures.s3 import BUCKET, SECRET, s3, s3_server  # noqa: F401 (fixtures)

REPO = "org/many-nodes"
URL = f"s3://{BUCKET}/hs/many-nodes"
SEED = 7
LAYOUTS = ((1, 4), (2, 2), (4, 1))  # nodes x ranks per node: world size 4


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """24 rows in 12 shards of 2 rows (random states, H=64)."""
    return random_build(tmp_path_factory.mktemp("nodes"), samples=24, tokens=32, hidden=64, part_size=2)


@pytest.fixture(autouse=True)
def checks_on(monkeypatch):
    monkeypatch.delenv(CHECK_ENV, raising=False)  # the readers check every block, whatever the shell's setting


def shard_bytes(build: Path) -> list[int]:
    return [p.stat().st_size for p in sorted((build / "data").iterdir())]


def all_ids(build: Path) -> list[str]:
    return [r["id"] for r in iter_torch(open_dataset(build), batch_size=8)]


@pytest.fixture(params=["hub", "s3"])
def published(request, build) -> str:
    """The build published as v1.0 on the test Hub or in the S3 store; -> what open_ranked is given."""
    if request.param == "hub":
        request.getfixturevalue("hub")
        push_dataset(build, REPO, "v1.0")
        return REPO
    request.getfixturevalue("s3")
    url = f"{URL}-{request.node.name.replace('[', '-').rstrip(']')}"
    push_objects(build, url, "v1.0")
    return url


def read_layout(source: str, nodes: int, per_node: int, cache: Path, cache_bytes: int, **kw) -> dict:
    """Every rank of a layout read in this process, each node with its own cache: ids per rank per batch."""
    out: dict = {"ranks": {}, "fetched": [], "peak": []}
    for n in range(nodes):
        fetched = peak = 0
        for lr in range(per_node):
            reader = open_ranked(source, revision="v1.0", cache_dir=cache / f"node-{n}", cache_bytes=cache_bytes,
                                 batch_size=2, seed=SEED, rank=n * per_node + lr, world_size=nodes * per_node,
                                 local_rank=lr, local_world_size=per_node, **kw)
            out["ranks"][n * per_node + lr] = [[r["id"] for r in batch] for batch in reader]
            fetched += reader.cache.fetched_bytes
            peak += reader.cache.peak_bytes
            reader.cache.close()
        out["fetched"].append(fetched)
        out["peak"].append(peak)
    return out


def test_every_layout_reads_every_row_once_in_one_order_from_a_small_cache(published, build, tmp_path):
    sizes = shard_bytes(build)
    bound = 2 * 2 * max(sizes)  # per node: two ranks x two shards, a third of the version
    assert bound < sum(sizes) / 2
    seen = {}
    for nodes, per_node in LAYOUTS:
        got = read_layout(published, nodes, per_node, tmp_path / f"{nodes}x{per_node}", bound * per_node // 2)
        ids = [i for r in range(4) for b in got["ranks"][r] for i in b]
        assert sorted(ids) == sorted(all_ids(build))  # the version, each row once
        assert len({len(got["ranks"][r]) for r in range(4)}) == 1  # the same number of batches on every rank
        assert sum(got["fetched"]) == sum(sizes)  # 6 rows a rank = 3 whole shards: each shard fetched by one node
        assert all(p <= bound * per_node // 2 for p in got["peak"])
        seen[(nodes, per_node)] = got["ranks"]
    assert seen[(1, 4)] == seen[(2, 2)] == seen[(4, 1)]


def test_a_shard_cut_between_ranks_is_fetched_by_both_within_the_plans_bound(published, build, tmp_path):
    sizes = shard_bytes(build)
    got = read_layout(published, 5, 1, tmp_path, 1 << 30)  # 24 rows over 5 ranks: stretches of 5 cut 2-row shards
    assert sorted(i for r in range(5) for b in got["ranks"][r] for i in b) == sorted(all_ids(build))
    assert sum(sizes) < sum(got["fetched"]) <= fetch_factor(len(sizes), 5) * sum(sizes)


def test_a_later_epoch_is_another_order_of_the_same_rows(published, build, tmp_path):
    readers = [open_ranked(published, cache_dir=tmp_path / "c", cache_bytes=1 << 30, batch_size=4, seed=SEED,
                           rank=r, world_size=2, local_rank=r, local_world_size=2) for r in range(2)]
    orders = []
    for epoch in (0, 1):
        for rd in readers:
            rd.set_epoch(epoch)
        orders.append([r["id"] for rd in readers for b in rd for r in b])
    assert sorted(orders[0]) == sorted(orders[1]) == sorted(all_ids(build)) and orders[0] != orders[1]


@pytest.mark.parametrize("later_world", [2, 3])
def test_a_mid_epoch_state_resumes_at_another_world_size_with_exactly_the_rows_left(published, build, tmp_path,
                                                                                      later_world):
    first = [open_ranked(published, cache_dir=tmp_path / "a", cache_bytes=1 << 30, batch_size=2, seed=SEED, rank=r,
                         world_size=4, local_rank=r, local_world_size=4) for r in range(4)]
    done = []
    for rd in first:
        it = iter(rd)
        for _ in range(2):  # two steps on every rank
            done += [r["id"] for r in next(it)]
        it.close()
    states = [rd.state_dict() for rd in first]
    assert all(s == states[0] for s in states)  # one state, whichever rank saves it
    state = json.loads(json.dumps(states[0]))  # as a checkpoint keeps it
    rest = []
    for r in range(later_world):
        rd = open_ranked(published, cache_dir=tmp_path / "b", cache_bytes=1 << 30, batch_size=2, seed=SEED, rank=r,
                         world_size=later_world, local_rank=r, local_world_size=later_world)
        rd.load_state_dict(state)
        rest += [r["id"] for b in rd for r in b]
    assert len(done) == 16 and len(rest) == 8
    assert sorted(done + rest) == sorted(all_ids(build))  # the remaining rows exactly, each once


def test_two_nodes_of_two_processes_read_the_version_once(published, build, tmp_path, request):
    """2 nodes x 2 ranks as four processes (torchrun's variables), a cache folder per node."""
    env = root_env()  # the S3 server's variables are in this environment (the fixture), the Hub's added here
    if published == REPO:
        env = {**client_subprocess_env(request.getfixturevalue("hub"), tmp_path / "home"), "PYTHONPATH": env["PYTHONPATH"]}
    script = ("import json,sys; from hs_dataset.read.ranked import open_ranked\n"
              f"rd = open_ranked({published!r}, revision='v1.0', cache_dir=sys.argv[1], cache_bytes={4 * max(shard_bytes(build))},"
              f" batch_size=2, seed={SEED})\n"
              "ids = [[r['id'] for r in b] for b in rd]\n"
              "print(json.dumps({'ids': ids, 'fetched': rd.cache.fetched_bytes, 'peak': rd.cache.peak_bytes}))\n")
    procs = []
    for rank in range(4):
        node, lr = divmod(rank, 2)
        more = dict(RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(lr), LOCAL_WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-c", script, str(tmp_path / f"node-{node}")],
                                      env={**env, **more}, stdout=subprocess.PIPE, text=True))
    outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    ids = [i for o in outs for b in o["ids"] for i in b]
    assert sorted(ids) == sorted(all_ids(build))
    assert sum(o["fetched"] for o in outs) == sum(shard_bytes(build))
    assert all(o["peak"] <= 2 * max(shard_bytes(build)) for o in outs)
    in_process = read_layout(published, 2, 2, tmp_path / "same", 4 * max(shard_bytes(build)))
    assert [o["ids"] for o in outs] == [in_process["ranks"][r] for r in range(4)]


def flip_in_s3(url: str, rel: str) -> None:
    import fsspec  # deferred: s3fs, only here

    fs, root = fsspec.core.url_to_fs(url)
    path = f"{root}/versions/v1.0/{rel}"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x10
    fs.pipe_file(path, bytes(data))


@pytest.mark.usefixtures("s3")
def test_a_flipped_bit_in_a_stored_shard_is_refused_by_name_on_every_path(build, tmp_path, capsys):
    url = f"{URL}-flip"
    push_objects(build, url, "v1.0")
    name = sorted((build / "data").iterdir())[5].name
    flip_in_s3(url, f"data/{name}")
    with pytest.raises(IntegrityError, match=f"data/{name} as fetched its content hash differs"):
        for r in range(2):
            list(open_ranked(url, cache_dir=tmp_path / "c", cache_bytes=1 << 30, batch_size=2, rank=r, world_size=2,
                             local_rank=0, local_world_size=1))
    assert not [p for p in (tmp_path / "c").rglob("*") if p.name.endswith(name)]  # nothing of it kept
    with pytest.raises(IntegrityError, match=f"data/{name} as fetched"):
        open_dataset(url, revision="v1.0", local_dir=tmp_path / "copy")
    assert not (tmp_path / "copy" / "data" / name).exists()
    report = verify_object_version(url, revision="v1.0")
    assert not report.ok and [p.path for p in report.problems] == [f"data/{name}"]
    assert verify_object_version(url, revision="v1.0", quick=True).ok  # names and sizes only: same size
    assert cli_main(["verify", url, "--revision", "v1.0"]) == 1
    assert f"data/{name}" in capsys.readouterr().out


def test_a_hub_shard_damaged_on_the_way_is_refused_by_name(hub, build, tmp_path):
    push_dataset(build, REPO, "v1.0")
    shard = sorted((build / "data").iterdir())[3]
    obj = next(p for p in hub.objects_dir.iterdir() if p.stat().st_size == shard.stat().st_size
               and p.read_bytes() == shard.read_bytes())
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x10
    obj.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=f"data/{shard.name} as fetched its content hash differs"):
        for r in range(4):
            list(open_ranked(REPO, cache_dir=tmp_path / "c", cache_bytes=1 << 30, batch_size=2, rank=r, world_size=4,
                             local_rank=0, local_world_size=1))
    with pytest.raises(IntegrityError, match=f"data/{shard.name} as downloaded differs"):
        open_dataset(REPO, revision="v1.0", local_dir=tmp_path / "copy")
    report = verify_repo(REPO, revision="v1.0", local_dir=tmp_path / "check")
    assert not report.ok and [p.path for p in report.problems] == [f"data/{shard.name}"]


@pytest.mark.usefixtures("s3")
def test_a_store_version_is_immutable_and_reads_as_on_the_hub(build, tmp_path, capsys):
    url = f"{URL}-versions"
    first = push_objects(build, url, "v1.0")
    assert not first.already_there and "data/" + sorted((build / "data").iterdir())[0].name in first.uploaded
    assert push_objects(build, url, "v1.0").already_there  # the same build: nothing written
    other = random_build(tmp_path, samples=4, tokens=32, hidden=64, part_size=2, name="other")
    with pytest.raises(VersionExistsError, match="never change"):
        push_objects(other, url, "v1.0")
    assert cli_main(["push", str(other), url, "--version", "v1.1"]) == 0
    versions = list_object_versions(url)
    assert [(v.version, v.samples) for v in versions] == [("v1.0", 24), ("v1.1", 4)]
    assert cli_main(["versions", url]) == 0 and "v1.1" in capsys.readouterr().out
    ds = open_dataset(url, revision="v1.0", local_dir=tmp_path / "v10")
    assert [r["id"] for r in iter_torch(ds, batch_size=8)] == all_ids(build)
    assert len(open_dataset(url, local_dir=tmp_path / "newest")) == 4  # no revision: the newest version
    card = (tmp_path / "v10" / "README.md").read_text(encoding="utf-8")
    assert "v1.0" in card and SECRET not in card and "moto-key-id" not in card  # no credential in the card
    import fsspec  # deferred: s3fs, only here

    fs, root = fsspec.core.url_to_fs(url)
    assert not [p for p in fs.find(root) if SECRET.encode() in fs.cat_file(p)]  # nor in any file of the store
    assert "### Training on many nodes" in card and "open_ranked(\"s3://" in card


@pytest.mark.usefixtures("s3")
def test_a_killed_push_leaves_no_version_and_is_resumed(build, tmp_path):
    url = f"{URL}-killed"
    script = ("import sys; from pathlib import Path; import hs_dataset.hub.object_push as op\n"
              "real = op._put\n"
              "def put(store, version, rel, path, result):\n"
              "    if rel.endswith(Path(sys.argv[2]).name):\n"
              "        import os; os._exit(9)\n"
              "    real(store, version, rel, path, result)\n"
              "op._put = put\n"
              "op.push_objects(sys.argv[1], sys.argv[3], 'v1.0')\n")
    victim = sorted((build / "data").iterdir())[3]
    run = subprocess.run([sys.executable, "-c", script, str(build), str(victim), url], env=root_env(), timeout=300)
    assert run.returncode == 9
    assert list_object_versions(url) == []  # killed before its pointer: no version
    with pytest.raises(Exception, match="no versions"):
        open_dataset(url, local_dir=tmp_path / "none")
    again = push_objects(build, url, "v1.0")
    assert len(again.skipped) == 3 and f"data/{victim.name}" in again.uploaded  # resumed where it stopped
    assert verify_object_version(url, revision="v1.0").ok
