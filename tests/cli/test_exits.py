"""How the command starts and ends (issue 28): ``--version``, help and configuration errors without
torch, datasets or transformers imported; every push / versions / verify input error in one line, the
local checks before the network; SIGTERM of a build with tokenize workers: one line, no worker left,
the rerun resumes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hs_dataset.layout import STATE_DIR
from tests.fakehub.server import running_hub
from tests.fakehub.tools import client_subprocess_env
from tests.fixtures.builds import DEMO, ROOT
from tests.fixtures.cli import SCRIPT, run, user_error

HEAVY = ("torch", "datasets", "transformers", "pyarrow", "numpy", "huggingface_hub", "tqdm")
TOKEN = "hf_ExitsTestToken0123456789ABCDEFGHIJKL"
BAD_REPO = "not a/valid repo!"


@pytest.fixture(scope="module")
def plain_script(tmp_path_factory) -> str:
    """A builder script without a prepare() hook (the demo's makes its model, which imports torch)."""
    path = tmp_path_factory.mktemp("script") / "plain.py"
    path.write_text(f"CONFIG = {{'model': '/no/model', 'source': {str(DEMO)!r}, 'layers': [0]}}\n")
    return str(path)


def _imports(*argv: str) -> tuple[int, str, list[str]]:
    """Run ``hs-dataset ARGV`` in a fresh interpreter -> (exit status, stderr, the heavy modules it imported)."""
    code = ("import json, sys\nfrom hs_dataset.cli import main\ntry:\n    status = main(sys.argv[1:])\n"
            "except SystemExit as e:\n    status = e.code\n"
            f"print(json.dumps([status, [m for m in {HEAVY!r} if m in sys.modules]]), file=sys.stdout)")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                       cwd=str(ROOT))
    status, heavy = json.loads(r.stdout.strip().splitlines()[-1])
    return status, r.stderr, heavy


@pytest.mark.parametrize("case", ["--version", "typo", "build --help", "plan --help", "unknown field", "bad value",
                                  "backend option", "push --help"])
def test_starts_without_torch_datasets_or_transformers(case, plain_script):
    argv = {"--version": ["--version"], "typo": ["biuld", "x.py"], "build --help": ["build", "--help"],
            "plan --help": ["plan", "--help"], "push --help": ["push", "--help"],
            "unknown field": ["plan", plain_script, "--set", "max_lenght=5"],
            "bad value": ["build", plain_script, "-o", "/tmp/never", "--set", "max_length=abc"],
            "backend option": ["build", plain_script, "-o", "/tmp/never", "--set", "backend_options.batch_token=64"]}[case]
    status, err, heavy = _imports(*argv)
    assert heavy == [], heavy
    assert status == (0 if "help" in case or case == "--version" else 2), err
    if case == "typo":
        assert "invalid choice: 'biuld'" in err
    if case == "backend option":
        assert "did you mean 'batch_tokens'?" in err and err.count("\n") == 1


def test_plan_help_lists_the_fields_it_says_it_lists():
    r = run("plan", "--help")
    flat = " ".join(r.stdout.split())
    assert r.returncode == 0 and "set a config field (listed below)" in flat
    assert "config fields (--set NAME=VALUE" in flat and "tokenize_workers: int or null = null" in flat
    assert "backend_options of backend=sglang" in flat and "--sample N" in flat


@pytest.mark.parametrize("cmd", ["inspect", "push", "versions", "verify", "merge", "export", "import"])
def test_every_positional_says_what_it_is(cmd):
    r = run(cmd, "--help")
    assert r.returncode == 0
    positionals = r.stdout.split("positional arguments:\n")[1].split("\noptions:")[0].splitlines()
    named = [line for line in positionals if re.match(r"^  \S", line)]
    assert named and all(len(line.split(None, 1)) == 2 for line in named), positionals  # a name, then its help


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def offline(tmp_path) -> dict:
    """A token, and an endpoint nothing listens on (the real Hub with no network answers the same way)."""
    with running_hub(tmp_path) as hub:
        env = client_subprocess_env(hub, tmp_path / "home", token=TOKEN)
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{_free_port()}"
    return env


def test_a_bad_repo_id_is_one_line_before_the_network(offline, tmp_path):
    # the demo model made afresh (HF_HUB_DISABLE_PROGRESS_BARS=1 is set: making it printed a warning once)
    offline = dict(offline, HS_DATASET_CACHE=str(tmp_path / "demo-cache"))
    for args, cmd in ((["push", str(tmp_path), BAD_REPO, "--version", "v1.0"], "push"),
                      (["versions", BAD_REPO], "versions"),
                      (["verify", BAD_REPO, "--revision", "v1.0"], "verify"),
                      (["build", SCRIPT, "-o", str(tmp_path / "o"), "--push", BAD_REPO, "--version", "v1.0"], "build")):
        r = run(*args, env=offline)
        user_error(r, f"invalid repo id {BAD_REPO!r}", "org/name", cmd=cmd)
        assert r.stderr.count("\n") == 1 and "HFValidationError" not in r.stderr and "cannot reach" not in r.stderr


def test_the_local_checks_come_before_the_network(offline, tmp_path):
    missing = tmp_path / "no-such-build"
    user_error(run("push", str(missing), "org/x", "--version", "v1.0", env=offline),
               f"{missing}: no such build directory", cmd="push")
    (tmp_path / "file").write_text("x")
    user_error(run("push", str(tmp_path / "file"), "org/x", "--version", "v1.0", env=offline),
               "is a file, not a build directory", cmd="push")
    user_error(run("build", SCRIPT, "-o", str(tmp_path / "o"), "--push", "org/x", "--version", "main", env=offline),
               "invalid version name 'main'", cmd="build")
    user_error(run("verify", "org/x", "--revision", "v1 0", env=offline), "invalid revision 'v1 0'", cmd="verify")
    r = run("verify", "runs/kimi-hs", env=offline)  # a missing directory that could also be a repo id
    user_error(r, "runs/kimi-hs: no such build directory here; as a repo id: cannot reach", cmd="verify")
    r = run("verify", str(missing), env=offline)
    user_error(r, "no such build directory", cmd="verify")
    assert "cannot reach" not in r.stderr


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_sigterm_of_a_build_with_tokenize_workers_is_one_line_and_resumes(tiny_model, tmp_path):
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "hs_dataset.cli", "build", SCRIPT, "--model", tiny_model, "--max-samples", "24",
            "--set", "part_size=2", "--set", "tokenize_workers=2", "-o", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (out / STATE_DIR / "parts" / "part-00001.json").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    workers = _children(proc.pid)
    assert len(workers) >= 2
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    m = re.search(r"^hs-dataset: terminated \(SIGTERM\) after (\d+) of 12 parts; run the same command again to resume$",
                  err.strip().splitlines()[-1])
    assert m and int(m.group(1)) >= 2, err[-2000:]
    deadline = time.time() + 30  # no worker outlives the build (nor multiprocessing's resource tracker)
    while [p for p in workers if _alive(p)]:
        assert time.time() < deadline, [(p, Path(f"/proc/{p}/cmdline").read_bytes()) for p in workers if _alive(p)]
        time.sleep(0.1)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and f"{int(m.group(1))} already done" in r.stdout, r.stdout + r.stderr[-2000:]
