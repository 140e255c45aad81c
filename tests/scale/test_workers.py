"""Scale-out one version built by many workers, then merged (hs_dataset.scale).

A build split into shares (as a Slurm job array, torchrun or Ray runs it) and merged must hold the
rows, hs_dataset.json (apart from its build command), card and ``load_dataset`` result of a
single-worker build of the same source; an incomplete or mismatched set of shares is refused,
naming the odd share.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hs_dataset import cli
from hs_dataset.write.driver import build
from hs_dataset.write.shares import WorkerShare, read_share, share_dir, share_parts
from hs_dataset.errors import ConfigError, ShareError
from hs_dataset.integrity.verify import verify_build
from hs_dataset.layout import DATA_DIR, META_FILE, README_FILE, STATE_DIR
from hs_dataset.scale.launchers import launcher_share, pin_local_gpus, resolve_share, single_worker_command, worker_resources
from hs_dataset.scale.merge import merge_shares
from hs_dataset.scale.worker import build_share
from tests.fixtures.builds import DEMO, LAYERS, config, content_hash, load_built

ROOT = Path(__file__).resolve().parents[2]


def write_script(path: Path, model: str) -> Path:
    """A builder script with the configuration of :func:`tests.fixtures.builds.config` (24 rows, parts of 4)."""
    cfg = dict(model=model, layers=list(LAYERS), source=str(DEMO), max_length=256, part_size=4, max_samples=24,
               backend_options={"device": "cpu", "batch_tokens": 2048})
    path.write_text(f"CONFIG = {cfg!r}\n")
    return path


def run_cli(monkeypatch, args: list[str], env: dict[str, str] | None = None) -> int:
    """``hs-dataset ARGS`` in this process, with ``env`` set (a launcher's variables)."""
    with monkeypatch.context() as m:
        for k in ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN", "RANK", "WORLD_SIZE",
                  "LOCAL_RANK"):
            m.delenv(k, raising=False)
        for k, v in (env or {}).items():
            m.setenv(k, v)
        m.setattr(sys, "argv", ["hs-dataset", *args])
        return cli.main(args)


def same_build(single: Path, merged: Path) -> None:
    """Rows, metadata (but the build command), card and load_dataset result of two builds are equal."""
    assert content_hash(merged) == content_hash(single)
    a, b = (json.loads((d / META_FILE).read_text()) for d in (single, merged))
    assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} <= {"build_command"}
    ra, rb = ((d / README_FILE).read_text().replace(m["build_command"], "CMD").replace(str(d), "OUT")
              for d, m in ((single, a), (merged, b)))
    assert ra == rb
    assert (single / "rejects.jsonl").read_text() == (merged / "rejects.jsonl").read_text()
    assert load_built(merged).data.table.equals(load_built(single).data.table)
    assert verify_build(merged).ok


@pytest.fixture(scope="module")
def single(tiny_model, backend, tmp_path_factory) -> Path:
    """The single-worker build every split build must equal (read-only)."""
    out = tmp_path_factory.mktemp("single") / "out"
    build(config(tiny_model), out, backend=backend, progress=False, build_command="hs-dataset build (single)")
    return out


@pytest.fixture(scope="module")
def slurm(tiny_model, tmp_path_factory) -> tuple[Path, Path, str]:
    """4 shares built one after the other as the tasks of a Slurm job array (SLURM_ARRAY_TASK_*), with
    the command line; the last one merges. -> (output, builder script, what the last task printed)."""
    import contextlib
    import io

    from _pytest.monkeypatch import MonkeyPatch

    root = tmp_path_factory.mktemp("slurm")
    script = write_script(root / "tiny.py", tiny_model)
    out = root / "out"
    mp = MonkeyPatch()
    try:
        for task in (3, 1, 0, 2):  # the order an array runs its tasks in is not fixed
            assert not (out / META_FILE).exists()  # not before the last share
            env = {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "0"}
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                assert run_cli(mp, ["build", str(script), "-o", str(out), "--workers", "auto", "--no-progress"],
                               env) == 0
    finally:
        mp.undo()
    return out, script, printed.getvalue()


def test_shard_plan_and_launchers():
    assert share_parts(10, 4) == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]
    assert share_parts(2, 3) == [[0], [1], []]
    assert sorted(p for s in share_parts(101, 7) for p in s) == list(range(101))
    with pytest.raises(ConfigError):
        share_parts(4, 0)
    # Slurm: --array=10-40:10 -> tasks 10, 20, 30, 40 are shares 0..3
    slurm = {"SLURM_ARRAY_TASK_ID": "30", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "10",
             "SLURM_ARRAY_TASK_STEP": "10"}
    assert launcher_share(slurm) == (2, 4, "Slurm array")
    assert launcher_share({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == (5, 8, "torchrun")
    assert launcher_share({}) is None
    with pytest.raises(ConfigError, match="both"):
        launcher_share({**slurm, "RANK": "0", "WORLD_SIZE": "2"})
    assert resolve_share("auto", None, slurm) == WorkerShare(2, 4)
    assert resolve_share("4", None, slurm) == WorkerShare(2, 4)
    assert resolve_share(3, 1, {}) == WorkerShare(1, 3)
    for args, env, what in [(("auto", None), {}, "none is set"), ((4, None), {}, "needs --worker-index"),
                            ((None, 1), {}, "needs --workers"), ((8, None), slurm, "has 4 workers"),
                            ((4, 4), {}, "index must be in"), (("x", 0), {}, "expected a number")]:
        with pytest.raises(ConfigError, match=what):
            resolve_share(*args, env)
    cmd = "hs-dataset build s.py -o 'my out' --workers auto --worker-index=2 --ray ray://h:10001 --no-progress"
    assert single_worker_command(cmd) == "hs-dataset build s.py -o 'my out' --no-progress"
    assert single_worker_command("hs-dataset build s.py --ray -o x") == "hs-dataset build s.py -o x"


def test_engine_resources_and_torchrun_gpus(tiny_model):
    sgl = config(tiny_model, backend="sglang", backend_options={"tp_size": 4})
    assert worker_resources(sgl) == (1.0, 4.0)
    assert worker_resources(config(tiny_model, backend="sglang", backend_options={"sglang_url": "http://h"})) == (1, 0)
    assert worker_resources(config(tiny_model)) == (1.0, 0.0)  # device cpu
    assert worker_resources(config(tiny_model, backend_options={}), gpus_available=True) == (1.0, 1.0)
    env = {"LOCAL_RANK": "1"}
    assert pin_local_gpus(config(tiny_model, backend="sglang", backend_options={"tp_size": 2}), env) == "2,3"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert pin_local_gpus(sgl, {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "7"}) is None  # the launcher chose
    assert pin_local_gpus(config(tiny_model), {"LOCAL_RANK": "1"}) is None  # CPU


def test_slurm_array_shards_merge_into_the_single_worker_build(slurm, single, tiny_model):
    out, script, printed = slurm  # the last task's output: it merged
    assert "built share 2 of 4" in printed and "merged 4 shares (6 parts)" in printed and "6 files hard-linked" in printed
    same_build(single, out)
    meta = json.loads((out / META_FILE).read_text())
    assert meta["build_command"] == f"hs-dataset build {script} -o {out} --no-progress"  # the single-worker command
    for f in (out / DATA_DIR).iterdir():  # hard links: no shard data copied
        part = int(f.name.split("-")[1])
        twin = share_dir(out, WorkerShare(part % 4, 4)) / DATA_DIR / f.name
        assert os.path.samefile(f, twin)
    # the shares' records hold the whole plan; a share holds no hs_dataset.json (it cannot be pushed by mistake)
    r = read_share(share_dir(out, WorkerShare(1, 4)))
    assert r["plan"] == {"parts": 6, "rows": 24, "part_size": 4} and r["parts"] == [1, 5] and r["done"]
    assert not (share_dir(out, WorkerShare(1, 4)) / META_FILE).exists()
    # the merged build is an ordinary build: the same command in one process resumes it (nothing to do) ...
    s = build(config(tiny_model), out, progress=False)
    assert (s.parts_built, s.parts_skipped) == (0, 6)
    # ... and merging again is harmless
    assert merge_shares(out).linked == 6
    same_build(single, out)


def test_merge_refuses_missing_duplicated_unfinished_damaged_and_other_config(slurm, tiny_model, backend, tmp_path):
    out, _, _ = slurm
    shares = [share_dir(out, WorkerShare(i, 4)) for i in range(4)]
    target = tmp_path / "merged"

    def refused(dirs, match, **kw):
        with pytest.raises(ShareError, match=match):
            merge_shares(target, dirs, **kw)
        assert not (target / META_FILE).exists()

    refused([shares[0], shares[1], shares[3]], r"share 2 of 4 \(parts \[2\]\) is missing")
    copy = tmp_path / "copy-of-1"
    shutil.copytree(shares[1], copy)
    refused([shares[0], shares[1], copy, shares[2], shares[3]],
            re.escape(f"share 1 of 4 is given twice: {shares[1]} and {copy}"))
    refused([shares[0], shares[1], shares[1]], "is given twice")
    # another configuration (the loss mask) for share 2
    other = tmp_path / "other-2"
    build_share(config(tiny_model, mask="last"), other, WorkerShare(2, 4), backend=backend, progress=False, merge=False)
    odd = share_dir(other, WorkerShare(2, 4))
    refused([shares[0], shares[1], odd, shares[3]],
            re.escape(f"share {odd} was built with another configuration") + ".*mask: 'last' instead of 'all'")
    # another plan (max_samples) with the same configuration
    short = tmp_path / "short-2"
    build_share(config(tiny_model, max_samples=20), short, WorkerShare(2, 4), backend=backend, progress=False, merge=False)
    refused([shares[0], shares[1], share_dir(short, WorkerShare(2, 4)), shares[3]], "another plan.*rows: 20")
    # an unfinished share: a part record lost
    (copy / STATE_DIR / "parts" / "part-00005.json").unlink()
    refused([shares[0], copy, shares[2], shares[3]], re.escape(f"share 1 of 4 ({copy}) is not finished: 1 of 2 parts"))
    # a damaged shard file: a flipped byte in the middle is found by the full check, and marked for the rebuild
    bad = tmp_path / "bad-3"
    shutil.copytree(shares[3], bad)
    victim = sorted((bad / DATA_DIR).iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    refused([shares[0], shares[1], shares[2], bad],
            re.escape(f"share {bad} does not match") + f".*{victim.name} its content hash differs", full=True)
    assert "3" in json.loads((bad / STATE_DIR / "damaged.json").read_text())
    refused([tmp_path], "is not a share build")


def test_merge_command_and_a_merge_across_file_systems(slurm, single, capsys):
    """``hs-dataset merge OUT SHARD...`` into a folder on another file system (/dev/shm, a tmpfs): the
    shard files cannot be hard-linked there, so they are copied, and the merge says so."""
    import tempfile

    out, _, _ = slurm
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(out).st_dev:
        pytest.skip("needs /dev/shm on another file system than the test's temporary folder")
    target = Path(tempfile.mkdtemp(prefix="hs-merge-", dir=shm)) / "merged"
    try:
        shares = [str(share_dir(out, WorkerShare(i, 4))) for i in range(4)]
        capsys.readouterr()
        assert cli.main(["merge", str(target), *shares]) == 0
        printed = capsys.readouterr().out
        assert "0 files hard-linked, 6 copied" in printed and "another file system" in printed, printed
        same_build(single, target)
        assert cli.main(["merge", str(target.parent / "other"), *shares[:3]]) == 2  # one line, no traceback
        err = capsys.readouterr().err
        assert re.search(r"hs-dataset merge: error: .*share 3 of 4 .* is missing", err) and "Traceback" not in err, err
    finally:
        shutil.rmtree(target.parent, ignore_errors=True)


def test_merged_build_pushes_like_any_build(slurm, single, tmp_path):
    import datasets

    from hs_dataset.hub.publish import push_dataset
    from tests.fakehub.server import running_hub
    from tests.fakehub.tools import hub_client_env

    out, _, _ = slurm
    with running_hub(tmp_path) as hub, hub_client_env(hub, tmp_path / "home", token="hf_ScaleoutTest0123456789abcdef"):
        result = push_dataset(out, "org/merged", "v1.0")
        files = hub.files_at("dataset", "org/merged", "v1.0")
        assert not any(p.startswith(STATE_DIR) for p in files)  # the shares stay local
        assert sorted(p for p in files if p.startswith("data/")) == sorted(
            f"data/{f.name}" for f in (out / DATA_DIR).iterdir())
        remote = datasets.load_dataset("org/merged", revision=result.commit_sha, split="train",
                                       cache_dir=str(tmp_path / "dcache"))
        assert remote.data.table.equals(load_built(single).data.table)


def test_torchrun_workers_run_side_by_side_and_the_last_one_merges(tiny_model, single, tmp_path):
    """Two workers at once on one machine, as ``torchrun --nproc-per-node 2`` starts them."""
    script = write_script(tmp_path / "tiny.py", tiny_model)
    out = tmp_path / "out"
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, "-m", "hs_dataset.cli", "build", str(script), "-o", str(out),
                                       "--workers", "auto", "--no-progress"], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sum("merged 2 shares (6 parts)" in o for o in outputs) >= 1, outputs
    same_build(single, out)


# ------------------------------------------------------------------------------------------- Ray


def lock_holder(share: Path) -> int | None:
    """The pid of the process holding ``share``'s build lock (None: nobody holds it)."""
    lock = share / STATE_DIR / "lock"
    try:
        pid = int(lock.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None  # not held
    except BlockingIOError:
        pass
    finally:
        os.close(fd)
    try:  # that pid has the lock file open (not a stale pid in the file)
        if any(os.path.realpath(f"/proc/{pid}/fd/{n}") == str(lock.resolve()) for n in os.listdir(f"/proc/{pid}/fd")):
            return pid
    except OSError:
        pass
    return None


@pytest.mark.slow
def test_ray_two_workers_one_killed_mid_shard_and_retried(tiny_model, single, tmp_path, monkeypatch, capsys):
    ray = pytest.importorskip("ray")
    script = write_script(tmp_path / "tiny.py", tiny_model)
    out = tmp_path / "out"
    victim = share_dir(out, WorkerShare(0, 2))
    killed: list[int] = []

    def kill_mid_shard() -> None:
        deadline = time.time() + 240
        while time.time() < deadline and not killed:
            records = len(list((victim / STATE_DIR / "parts").glob("part-*.json"))) if victim.is_dir() else 0
            pid = lock_holder(victim) if 1 <= records < 3 else None
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.005)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        killer = threading.Thread(target=kill_mid_shard, daemon=True)
        killer.start()
        capsys.readouterr()
        assert run_cli(monkeypatch, ["build", str(script), "-o", str(out), "--ray", "--no-progress"]) == 0
        printed = capsys.readouterr().out
        killer.join(timeout=1)
    finally:
        ray.shutdown()
    assert killed, f"share 0 was never seen mid-build: {printed}"
    assert "2 shares as Ray tasks (1 CPU, 0 GPU each; 2 at once)" in printed
    done = dict(re.findall(r"share (\d) of 2 done on \S+ \(pid (\d+)\)", printed))
    assert set(done) == {"0", "1"} and int(done["0"]) != killed[0], printed  # share 0 ran again in a new worker
    resumed = re.search(r"share 0 of 2 done .*?: .*?; (\d+) parts built, (\d+) already done", printed)
    assert resumed and int(resumed.group(2)) >= 1 and int(resumed.group(1)) + int(resumed.group(2)) == 3, printed
    assert "merged 2 shares (6 parts)" in printed
    same_build(single, out)


def test_a_merged_build_gets_the_reject_rate_check_of_a_single_worker(tiny_model, tmp_path, monkeypatch, capsys):
    """The worker that merges checks --max-reject-rate on the merged counts, as one worker's build does."""
    script = write_script(tmp_path / "tiny.py", tiny_model)
    out = tmp_path / "out"
    many = ["--set", "max_length=100", "--set", "truncation=reject", "--no-progress"]  # many demo rows are longer
    assert run_cli(monkeypatch, ["build", str(script), "-o", str(out), "--workers", "2", "--worker-index", "0",
                                 *many]) == 0  # one share: nothing merged, nothing to check yet
    assert run_cli(monkeypatch, ["build", str(script), "-o", str(out), "--workers", "2", "--worker-index", "1",
                                 *many]) == 2  # the last one merged: the merged build fails the check
    err = capsys.readouterr().err
    assert "more than --max-reject-rate 0.1" in err and (out / META_FILE).exists(), err
    rejected = sum(1 for _ in (out / "rejects.jsonl").open())
    assert f"{rejected} of 24 samples rejected" in err
