"""Plain ``datasets`` paths on a build: ``load_dataset(dir)`` never returns another build's rows from its cache,
``datasets-cli test DIR --save_info`` leaves a card that verifies, and verify's repair command runs from any folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets

from hs_dataset.demo.tiny import make_tiny_model_dir
from hs_dataset.integrity.verify import verify_build
from hs_dataset.layout import README_FILE
from hs_dataset.write.driver import build
from tests.fixtures.builds import DEMO, LAYERS, config, root_env


def test_load_dataset_of_a_rebuilt_folder_returns_the_new_rows(tmp_path):
    a = make_tiny_model_dir(tmp_path / "a", seed=0)
    b = make_tiny_model_dir(tmp_path / "b", seed=1)
    out, cache = tmp_path / "out", str(tmp_path / "hf-cache")  # one datasets cache, as on a user's machine
    build(config(str(a), max_samples=4), out, progress=False)
    first = datasets.load_dataset(str(out), split="train", cache_dir=cache)
    shutil.rmtree(out)
    build(config(str(b), max_samples=4), out, progress=False)  # another model: the same shapes and row count
    second = datasets.load_dataset(str(out), split="train", cache_dir=cache)
    fresh = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "fresh-cache"))
    assert first.num_rows == second.num_rows == 4
    assert second["hidden_final"] == fresh["hidden_final"] != first["hidden_final"]
    assert "hs_dataset build " in (out / README_FILE).read_text()  # the content id datasets keys its cache on


def test_datasets_cli_save_info_leaves_a_card_that_verifies(tiny_model, backend, tmp_path):
    out = tmp_path / "out"
    build(config(tiny_model, max_samples=4), out, backend=backend, progress=False)
    before = (out / README_FILE).read_text()
    r = subprocess.run([sys.executable, "-c", "from datasets.commands.datasets_cli import main; main()", "test",
                        str(out), "--save_info", "--cache_dir", str(tmp_path / "c")],
                       capture_output=True, text=True, env=root_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    after = (out / README_FILE).read_text()
    assert after != before and "download_size" in after  # datasets rewrote dataset_info
    report = verify_build(out)
    assert report.ok, [str(p) for p in report.problems]
    # a wrong download_size is still refused
    (out / README_FILE).write_text(after.replace("download_size: ", "download_size: 1"))
    assert not verify_build(out).ok


def test_the_repair_command_verify_prints_runs_from_any_folder(tiny_model, tmp_path):
    work, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    cfg = dict(model=tiny_model, layers=list(LAYERS), source=str(DEMO), max_length=256, part_size=4, max_samples=4,
               backend_options={"device": "cpu", "batch_tokens": 2048})
    (work / "tiny.py").write_text(f"CONFIG = {cfg!r}\n")
    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "build", "tiny.py", "-o", "out", "--no-progress"],
                       cwd=work, capture_output=True, text=True, env=root_env(), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = work / "out"
    readme = out / README_FILE
    readme.write_text(readme.read_text().replace("num_examples: 4", "num_examples: 5"))
    here = os.getcwd()
    os.chdir(elsewhere)
    try:
        report = verify_build(out)
    finally:
        os.chdir(here)
    assert not report.ok and "`cd " in report.repair
    command = report.repair.split("`")[1]
    bin_dir = str(Path(sys.executable).parent)
    env = root_env(PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    r = subprocess.run(command, shell=True, cwd=elsewhere, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, (command, r.stderr[-2000:])
    assert verify_build(out).ok
