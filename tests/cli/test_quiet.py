"""What a user should not see (issue 49): a misspelt flag is one line and a pointer to --help (not the usage
first), `verify --stats` prints no PyTorch warning, and `build --push --no-progress` shows no upload bar on a
terminal. Each through the real `hs-dataset` in a subprocess."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from hs_dataset.integrity.value_stats import column_stats
from tests.fakehub.server import running_hub
from tests.fakehub.tools import client_subprocess_env
from tests.fixtures.cli import demo, on_a_terminal, run, user_error

TOKEN = "hf_QuietTestToken0123456789ABCDEFGHIJK"
REPO = "org/quiet-demo"


def test_a_misspelt_flag_is_one_line_with_the_closest_flag_and_see_help(tiny_model, tmp_path):
    r = run("build", *demo(tiny_model), "-o", str(tmp_path / "out"), "--no-porgress")
    last = user_error(r, "unrecognized arguments: --no-porgress", "did you mean '--no-progress'?",
                      "see hs-dataset build --help")
    assert r.stderr.strip() == last and "usage:" not in r.stderr
    assert not (tmp_path / "out").exists()
    r = run("verify", str(tmp_path), "--stast")
    assert r.stderr.strip() == user_error(r, "did you mean '--stats'?", "see hs-dataset verify --help", cmd="verify")
    r = run("build", *demo(tiny_model))  # argparse's own errors (a missing --output) are one line too
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "usage:" not in r.stderr
    assert "--output" in r.stderr and "(see hs-dataset build --help)" in r.stderr
    r = run("biuld")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "invalid choice: 'biuld'" in r.stderr


def test_statistics_of_read_only_states_raise_no_warning():
    rng = np.random.default_rng(0)
    bits = rng.standard_normal((16, 64)).astype(np.float32).view(np.uint32) >> 16
    codes, scale = rng.integers(0, 0x7E, (16, 64), dtype=np.uint8), np.ones(16, np.float32)
    for row, column in (({"s": bits.astype(np.uint16)}, "s"), ({"f": codes, "f_scale": scale}, "f")):
        writable = column_stats(row, column)
        for a in row.values():
            a.flags.writeable = False  # as a state mapped from a shard
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert column_stats(row, column) == writable


def test_verify_stats_of_an_fp8_build_prints_no_warning(tiny_model, tmp_path):
    out = tmp_path / "fp8"
    r = run("build", *demo(tiny_model, "--storage-dtype", "fp8_e4m3"), "-o", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run("verify", str(out), "--stats")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "they match the recorded statistics" in r.stdout
    assert "Warning" not in r.stderr and "not writable" not in r.stderr, r.stderr


def test_build_push_no_progress_shows_no_upload_baron_a_terminal(tiny_model, tmp_path: Path):
    with running_hub(tmp_path, write_token=TOKEN) as hub:
        env = client_subprocess_env(hub, tmp_path / "home", token=TOKEN)
        env.pop("HF_HUB_DISABLE_PROGRESS_BARS")  # what a user's shell has: huggingface_hub's bars on
        args = ["build", *demo(tiny_model, "--max-samples", "4"), "-o", str(tmp_path / "out"),
                "--push", REPO, "--version", "v1.0"]
        status, err = on_a_terminal([*args, "--no-progress"], env)
        assert status == 0, err[-3000:]
        assert hub.commit_of("dataset", REPO, "v1.0") is not None
        assert err.strip() == "", err  # no bar: neither the build's nor huggingface_hub's upload bar
