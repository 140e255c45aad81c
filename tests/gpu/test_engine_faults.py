"""The SGLang path fails like the rest of the tool (issue 29), on a real GPU through the real CLI:

* a scheduler killed mid-build ends the build within seconds, in one line naming it and its signal,
  exit 2, parts kept; the rerun resumes, every source row exactly once;
* a SIGKILLed builder takes its engine with it: no SGLang process of it 10 s later, the GPU memory free;
* a successful build's output holds no traceback and no logging error, and ends with its summary;
* an engine that cannot start says why in one line (not enough memory at mem_fraction_static, a
  model directory SGLang cannot load, a port in use).

    source .gpu/device-setup.sh && python3 -m pip install --no-deps --no-build-isolation --no-index -e . \\
        && python -m pytest -m gpu -v -rs tests/gpu/test_engine_faults.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.gpu.models import GPU_MARKS
from tests.gpu.test_sglang import ENGINE_ARGS, REPORT

pytestmark = GPU_MARKS

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "builder_scripts" / "data" / "demo_conversations.jsonl"
FAULTS = REPORT.with_name("gpu_faults.json")
_faults: dict = {}


def _dump() -> None:
    FAULTS.write_text(json.dumps(_faults, indent=1))


def source(path: Path, rows: int) -> Path:
    """``rows`` conversations (the demo's, repeated with a row number in the first turn)."""
    demo = [json.loads(line) for line in DEMO.read_text().splitlines() if line.strip()]
    with open(path, "w") as f:
        for i in range(rows):
            row = json.loads(json.dumps(demo[i % len(demo)]))
            turns = row.get("conversations") or row.get("messages")
            key = "value" if "conversations" in row else "content"
            turns[0][key] = f"({i}) {turns[0][key]}"
            f.write(json.dumps(row) + "\n")
    return path


def script(path: Path, model: str, src: Path, **engine: object) -> Path:
    """A builder script for the tiny Llama through SGLang."""
    config = {"model": model, "layers": [1, 3, 7], "source": str(src), "max_length": 512, "backend": "sglang",
              "part_size": 32, "backend_options": {"max_inflight": 16, "ring_bytes": 256 << 20,
                                                   "engine_args": {**ENGINE_ARGS, **engine}}}
    path.write_text(f"import json\n\nCONFIG = json.loads({json.dumps(json.dumps(config))})\n")
    return path


def cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hs_dataset.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def parts_done(out: Path) -> int:
    return len(list((out / ".hs_build" / "parts").glob("part-*.json")))


def sglang_processes(root_pid: int | None = None) -> list:
    import psutil

    procs = psutil.Process(root_pid).children(recursive=True) if root_pid else psutil.process_iter()
    found = []
    for p in procs:
        try:
            if "sglang::" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def wait_for(pred, limit: float, what: str) -> None:
    deadline = time.time() + limit
    while not pred():
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def llama(models):
    from hs_dataset.demo.tiny import make_tiny_tokenizer

    make_tiny_tokenizer(models["llama"], template="chatml")
    return models["llama"]


def test_a_dead_scheduler_ends_the_build_in_one_line_and_the_rerun_resumes(llama, tmp_path):
    src = source(tmp_path / "src.jsonl", 4096)
    s = script(tmp_path / "s.py", llama, src)
    out = tmp_path / "out"
    p = cli("build", str(s), "-o", str(out), "--no-progress")
    wait_for(lambda: parts_done(out) >= 2 or p.poll() is not None, 300, "two committed parts")
    assert p.poll() is None, p.communicate()[0][-3000:]
    victims = [q for q in sglang_processes(p.pid) if "scheduler" in " ".join(q.cmdline())]
    assert victims, [q.cmdline() for q in sglang_processes(p.pid)]
    t = time.time()
    victims[0].kill()
    text = p.communicate(timeout=120)[0]
    seconds = time.time() - t
    last = text.strip().splitlines()[-1]
    _faults["scheduler_killed"] = {"exit": p.returncode, "seconds_to_exit": round(seconds, 1), "line": last,
                                   "last_lines": text.strip().splitlines()[-12:], "parts_kept": parts_done(out)}
    _dump()
    assert p.returncode == 2, text[-3000:]
    assert last.startswith("hs-dataset build: error: ") and "scheduler" in last and "SIGKILL" in last, last
    assert "Traceback" not in text, text[-3000:]
    assert seconds < 15
    kept = parts_done(out)
    assert kept >= 2
    r = cli("build", str(s), "-o", str(out), "--no-progress")
    rerun = r.communicate(timeout=900)[0]
    assert r.returncode == 0, rerun[-3000:]
    from hs_dataset.read import open_dataset

    ds = open_dataset(out)
    ids = ds["id"]
    meta = json.loads((out / "hs_dataset.json").read_text())
    assert len(ids) == len(set(ids)) == meta["counts"]["written"]
    assert meta["counts"]["samples_in"] == 4096 == meta["counts"]["written"] + meta["counts"]["rejected"]
    _faults["scheduler_killed"]["rerun_rows"] = len(ids)
    _dump()


def test_a_killed_builder_takes_its_engine_with_it(llama, tmp_path):
    torch.cuda.init()
    free_before, total = torch.cuda.mem_get_info()
    src = source(tmp_path / "src.jsonl", 4096)
    s = script(tmp_path / "s.py", llama, src)
    out = tmp_path / "out"
    p = cli("build", str(s), "-o", str(out), "--no-progress")
    wait_for(lambda: parts_done(out) >= 1 or p.poll() is not None, 300, "a committed part")
    assert p.poll() is None
    engine = [q.pid for q in sglang_processes(p.pid)]
    assert engine
    os.kill(p.pid, signal.SIGKILL)
    p.wait(30)
    time.sleep(10)
    left = [q for q in sglang_processes() if q.pid in engine]
    free_after, _ = torch.cuda.mem_get_info()
    _faults["builder_killed"] = {"engine_pids": engine, "alive_after_10s": [q.pid for q in left],
                                 "free_gib_before": round(free_before / 2**30, 2),
                                 "free_gib_after": round(free_after / 2**30, 2)}
    _dump()
    assert not left, [q.cmdline() for q in left]
    assert free_after >= free_before - (1 << 30)  # back to what it was (within 1 GiB of other tenants' noise)


def test_a_successful_cli_build_ends_with_its_summary(llama, tmp_path):
    s = script(tmp_path / "s.py", llama, DEMO)
    p = cli("build", str(s), "-o", str(tmp_path / "out"), "--no-progress")
    text = p.communicate(timeout=900)[0]
    lines = [line for line in text.splitlines() if line.strip()]
    noise = ("Traceback", "Logging error", "Task was destroyed", "resource_tracker", "KeyError")
    _faults["clean_exit"] = {"exit": p.returncode, "last_lines": lines[-3:], "noise": [w for w in noise if w in text],
                             "sglang_bar": "Multi-thread loading" in text}  # SGLang's own, shown (engine.py says why)
    _dump()
    assert p.returncode == 0, text[-3000:]
    for bad in noise:  # no traceback or logging error in a successful build's output
        assert bad not in text, (bad, text[-3000:])
    assert lines[-1].startswith(("built ", "every reject with its reason")), lines[-3:]


def _taken_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


@pytest.mark.parametrize("fault", ["memory", "model", "port"])
def test_an_engine_that_cannot_start_says_why_in_one_line(llama, tmp_path, fault):
    held = None
    model = llama
    engine: dict = {}
    if fault == "memory":
        engine["mem_fraction_static"] = 0.001
    elif fault == "model":
        model = str(tmp_path / "bad-model")
        Path(model).mkdir()
        for f in Path(llama).iterdir():
            if f.name != "config.json" and f.is_file():
                os.symlink(f, Path(model) / f.name)
        cfg = json.loads((Path(llama) / "config.json").read_text())
        cfg["architectures"] = ["NoSuchModelForCausalLM"]
        cfg["model_type"] = "no_such_model"
        (Path(model) / "config.json").write_text(json.dumps(cfg))
    else:
        held = _taken_port()
        engine["nccl_port"] = held.getsockname()[1]
    s = script(tmp_path / "s.py", model, DEMO, **engine)
    t = time.time()
    p = cli("build", str(s), "-o", str(tmp_path / "out"), "--no-progress")
    text = p.communicate(timeout=600)[0]
    if held is not None:
        held.close()
    last = text.strip().splitlines()[-1]
    _faults[f"start_{fault}"] = {"exit": p.returncode, "line": last, "seconds": round(time.time() - t, 1)}
    _dump()
    assert p.returncode == 2 and last.startswith("hs-dataset build: error: "), text[-3000:]
    want = {"memory": "mem_fraction_static=0.001", "model": "could not load the model directory",
            "port": "port"}[fault]
    assert want in last, last
    assert not sglang_processes(), "an SGLang process outlived the failed start"
