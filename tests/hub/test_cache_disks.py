"""A version's folder on a read-only or full disk: a complete version opens without a write, anything else is one
line naming the folder (a real tmpfs mounted read-only or too small; skipped where this process may not mount)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hs_dataset.errors import OutputWriteError
from hs_dataset.hub.download import download_version
from hs_dataset.hub.publish import push_dataset
from hs_dataset.read import iter_torch, open_dataset
from tests.fixtures.builds import random_build

REPO = "org/cache-disks"
TOKEN = "hf_CacheDisksTestToken0123456789ABCDEFGH"


@pytest.fixture()
def disk(tmp_path):
    """A tmpfs of 64 MiB at ``tmp_path/disk`` -> a function remounting it read-only (or back)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("this process may not mount a tmpfs")

    def remount(ro: bool) -> None:
        subprocess.run(["mount", "-o", f"remount,{'ro' if ro else 'rw'}", str(mnt)], check=True)

    yield mnt, remount
    subprocess.run(["umount", str(mnt)], check=True)


def test_a_read_only_or_full_disk_is_one_line_and_a_complete_version_needs_no_write(hub, disk, tmp_path):
    mnt, remount = disk
    build = random_build(tmp_path, samples=4, tokens=64, hidden=256, part_size=2)
    push_dataset(build, REPO, "v1.0")
    first = download_version(REPO, revision="v1.0", local_dir=mnt / "v1")
    assert first.fetched
    remount(True)
    again = download_version(REPO, revision="v1.0", local_dir=mnt / "v1")  # complete: not a byte written
    assert again.fetched == () and again.commit == first.commit
    rows = list(iter_torch(open_dataset(REPO, revision="v1.0", local_dir=mnt / "v1")))
    assert len(rows) == 4
    with pytest.raises(OutputWriteError) as e:
        download_version(REPO, revision="v1.0", local_dir=mnt / "v2")  # nothing there yet: it must write
    assert str(mnt / "v2") in str(e.value) and "HF_HOME" in str(e.value) and "\n" not in str(e.value)
    remount(False)
    Path(mnt / "filler").write_bytes(b"\0" * (63 << 20))  # the disk full
    with pytest.raises(OutputWriteError) as e:
        download_version(REPO, revision="v1.0", local_dir=mnt / "v3")
    assert str(mnt / "v3") in str(e.value) and "\n" not in str(e.value)


def test_the_cli_on_a_read_only_or_full_hf_cache_says_one_line(hub, disk, tmp_path):
    import sys

    from tests.fakehub.tools import client_subprocess_env

    mnt, remount = disk
    build = random_build(tmp_path, samples=4, tokens=64, hidden=256, part_size=2)
    env = client_subprocess_env(hub, mnt / "home", token=TOKEN)
    (mnt / "home").mkdir()
    push = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "push", str(build), REPO, "--version", "v1.0",
                           "--no-progress"], capture_output=True, text=True, env=env, timeout=300)
    assert push.returncode == 0, push.stderr[-2000:]
    for ro in (True, False):
        if ro:
            remount(True)
        else:  # the cache full: every byte of the disk taken
            remount(False)
            subprocess.run(["sh", "-c", f"cat /dev/zero > {mnt / 'filler'}"], capture_output=True)
        r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "verify", REPO, "--revision", "v1.0"],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 2, (ro, r.returncode, r.stderr[-3000:])
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("hs-dataset verify: error: ") and str(mnt) in last, last
