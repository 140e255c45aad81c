"""The command line as a user meets it (issue 15), through the real `hs-dataset` in subprocesses: each
case asserts the exit code, that stderr holds no traceback, and that the message names the fix."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hs_dataset.capture.options import backend_options
from hs_dataset.cli.hub import dash_version
from hs_dataset.config import config_fields, describe_type, field_types
from hs_dataset.layout import BACKENDS, META_FILE, STATE_DIR
from hs_dataset.model_info import ModelInfo
from tests.fakehub.server import running_hub
from tests.fakehub.tools import client_subprocess_env, make_rows, write_built_dataset
from tests.fixtures.builds import DEMO, ROOT
from tests.fixtures.cli import SCRIPT, demo, on_a_terminal, run, user_error

TOKEN = "hf_CliTestToken0123456789ABCDEFGHIJKLM"
REPO = "org/cli-demo"


@pytest.fixture(scope="module")
def built(tiny_model, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A finished 16-sample demo build made by the CLI with stderr to a pipe (not a terminal)."""
    out = tmp_path_factory.mktemp("cli") / "demo"
    r = run("build", *demo(tiny_model), "-o", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


@pytest.fixture
def copy(built, tmp_path) -> Path:
    """A private copy of the finished build."""
    shutil.copytree(built[0], tmp_path / "demo")
    return tmp_path / "demo"


def _write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def mixed(tmp_path) -> Path:
    """10 demo conversations and 6 rows of another schema ({"text": ...}): 6 rejects of 16."""
    rows = [json.loads(line) for line in DEMO.read_text(encoding="utf-8").splitlines()[:10]]
    return _write_rows(tmp_path / "mixed.jsonl", rows + [{"text": f"note {i}"} for i in range(6)])


# ------------------------------------------------------------------ 1. one-line errors, exit 2
def _locked(out: Path):
    (out / STATE_DIR).mkdir(parents=True)
    fd = os.open(out / STATE_DIR / "lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"4242\n")
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


USER_ERRORS = {  # case: (extra arguments, words of the fix)
    "script missing": (["build", "no_such_script.py"], ["not found", "builder_scripts/tiny_demo.py"]),
    "source missing": (["--source", "/no/such/conversations.jsonl"], ["does not exist", ".jsonl"]),
    "bad layer": (["--layers", "0,9"], ["out of range", "valid ids are 0..3", "--layers"]),
    "output is a file": ([], ["is a file, not a directory", "--output"]),
    "locked output": ([], ["another hs-dataset build (pid 4242)", "wait for it to end"]),
    "config mismatch": (["--set", "max_length=128"], ["another configuration", "max_length: 512 -> 128",
                                                       "new --output"]),
    "unknown field": (["--set", "max_lenght=128"], ["did you mean 'max_length'?", "build --help"]),
    "bad value": (["--set", "max_length=abc"], ["expected an integer", "--set max_length=2048"]),
    "bad list": (["--layers", "one,two"], ["expected a list of integers", "1,29,57"]),
    "bad choice": (["--set", "mask=lst"], ["use one of all, last", "did you mean 'last'?"]),
    "backend option": (["--set", "backend_options.batch_token=64"], ["did you mean 'batch_tokens'?"]),
    "push without version": (["--push", REPO], ["--push needs --version", "--version v1.0"]),
}


@pytest.mark.parametrize("case", sorted(USER_ERRORS))
def test_user_errors_are_one_line_with_the_fix(case, tiny_model, built, tmp_path):
    extra, fix = USER_ERRORS[case]
    out = tmp_path / "out"
    fd = None
    if case == "output is a file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "out"
    elif case == "locked output":
        fd = _locked(out)
    elif case == "config mismatch":
        shutil.copytree(built[0], out)
    args = extra if case == "script missing" else ["build", *demo(tiny_model), *extra]
    try:
        r = run(*args, "-o", str(out))
    finally:
        if fd is not None:
            os.close(fd)
    user_error(r, *fix)
    assert r.stderr.count("\n") == 1  # nothing but that line


def test_debug_shows_the_traceback(tiny_model, tmp_path):
    r = run("build", *demo(tiny_model, "--set", "max_length=abc"), "-o", str(tmp_path / "o"), "--debug")
    assert r.returncode == 2 and "Traceback" in r.stderr and "ConfigError" in r.stderr
    r = run("build", *demo(tiny_model, "--set", "max_length=abc"), "-o", str(tmp_path / "o"),
            env=dict(os.environ, HS_DATASET_DEBUG="1"))
    assert r.returncode == 2 and "Traceback" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("hs-dataset build: error: max_length='abc'")


def test_unexpected_errors_keep_their_traceback(tiny_model, tmp_path):
    script = tmp_path / "broken.py"
    script.write_text(f"CONFIG = {{'model': {tiny_model!r}, 'source': {str(DEMO)!r}, 'layers': [0]}}\n"
                      "def prepare(config):\n    raise RuntimeError('a bug in the builder script')\n")
    r = run("build", str(script), "-o", str(tmp_path / "o"))
    assert r.returncode == 1 and "Traceback" in r.stderr and "a bug in the builder script" in r.stderr


# The build of the signal tests, run through the command line's own main() with one patch: ``when`` says
# where the process signals itself, so that the signal always lands mid-build (a signal timed from outside
# raced the build's end on a fast machine).
_SIGNALLED_BUILD = """
import os, signal, sys, time
import hs_dataset.write.driver as D
import hs_dataset.write.progress as P
sig, when = int(sys.argv[1]), sys.argv[2]
commit, row, seen = D.commit_part, P.BuildProgress.row, [0]
def commit_then_signal(*a, **k):
    commit(*a, **k)
    if a[2].i == 1:  # once the second part is committed, from the committer thread
        os.kill(os.getpid(), sig)
def row_in_native_code(self, *a):  # as pyarrow calling back into Python: an exception there is swallowed
    row(self, *a)
    seen[0] += 1
    if seen[0] == 5:
        try:
            os.kill(os.getpid(), sig)
            time.sleep(0.5)
        except KeyboardInterrupt:
            print("swallowed", file=sys.stderr)
if when == "after-commit":
    D.commit_part = commit_then_signal
else:
    P.BuildProgress.row = row_in_native_code
from hs_dataset.cli import main
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize("when", ["after-commit", "in-native-code"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_say_how_to_resume_and_the_same_command_does(tiny_model, tmp_path, sig, when):
    """Ctrl-C, and SIGTERM (what Slurm sends a preempted job): parts kept, one line, the rerun resumes. Also
    when the signal comes while native code runs Python that swallows the KeyboardInterrupt: the build
    notes it and stops at its next row (it used to go on and exit 0)."""
    out = tmp_path / "out"
    args = ["build", SCRIPT, "--model", tiny_model, "--max-samples", "16", "--set", "part_size=2", "-o", str(out)]
    proc = subprocess.run([sys.executable, "-c", _SIGNALLED_BUILD, str(int(sig)), when, *args], capture_output=True,
                          text=True, timeout=300)
    err = proc.stderr
    code, what = (130, "interrupted") if sig == signal.SIGINT else (143, r"terminated \(SIGTERM\)")
    assert proc.returncode == code and "Traceback" not in err, err[-3000:]
    assert "swallowed" not in err  # while a part is generated the signal is noted, never raised inside native code
    m = re.search(rf"^hs-dataset: {what} after (\d+) of 8 parts; run the same command again to resume$",
                  err.strip().splitlines()[-1])
    assert m and 1 <= int(m.group(1)) < 8, err[-2000:]
    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and f"{int(m.group(1))} already done" in r.stdout, r.stdout + r.stderr[-2000:]


# ------------------------------------------------------------------ 2. config from the command line
def test_build_help_lists_every_config_field_and_backend_option():
    r = run("build", "--help")
    assert r.returncode == 0
    flat = " ".join(r.stdout.split())
    types = field_types()
    for f in config_fields():
        assert f"{f.name}: {describe_type(types[f.name])} = " in flat, f.name
        assert " ".join(f.metadata["help"].split()) in flat, f.name
    for backend in BACKENDS:
        assert f"backend_options of backend={backend}" in flat
        for o in backend_options(backend):
            assert f" {o.name} = {json.dumps(o.default)}" in flat, (backend, o.name)
    for flag in ("--model", "--source", "--layers", "--max-samples", "--backend", "--storage-dtype"):
        assert flag in r.stdout


def test_version():
    from hs_dataset import __version__

    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"hs-dataset {__version__}"


def test_lists_of_ints_take_both_spellings(tiny_model):
    from hs_dataset.config import coerce_field

    assert coerce_field("layers", "0,1") == coerce_field("layers", "[0,1]") == coerce_field("layers", "0 1") == (0, 1)
    r = run("plan", *demo(tiny_model, "--set", "layers=[0,1]", "--layers", "0,2", "--max-samples", "3"))
    assert r.returncode == 0, r.stderr[-3000:]  # the flag comes last on the command line: it wins
    assert "captures 0, 2 + final (3 states)" in r.stdout and "this build reads 3" in r.stdout


# ------------------------------------------------------------------ 3. plan
def test_plan_prices_the_build_without_running_the_model(tiny_model, built):
    r = run("plan", *demo(tiny_model), "--tok-per-s", "1000", "--workers", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((built[0] / META_FILE).read_text())
    tokens = meta["counts"]["tokens_written"]
    out = r.stdout
    assert "16 to write, 0 rejected" in out and f"tokens:   {tokens:,} " in out  # what the build then wrote
    assert len(re.findall(r"^ +[\d,]+-[\d,]+ █+ +\d+$", out, re.M)) >= 2  # the length histogram
    assert "517 B/token" in out and "277 B/token" in out  # 4 states x 64 x 2 (bf16) / x (64 + 4) (fp8), + 5
    assert f"{tokens / 1000:.1f}s of prefill at 1,000 tok/s (given)" in out
    assert re.search(r"^ +0 +2 +8 ", out, re.M) and re.search(r"^ +1 +2 +8 ", out, re.M)  # shards: parts, samples
    assert "rejects:   none" in out


def test_plan_rejects_by_reason_and_dry_run_writes_nothing(tiny_model, mixed, tmp_path):
    out = tmp_path / "out"
    r = run("build", *demo(tiny_model, "--source", str(mixed)), "-o", str(out), "--dry-run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rejects:   6 of 16 samples (37.5%), by reason:" in r.stdout and "found keys ['text']" in r.stdout
    assert not out.exists()


def test_plan_time_estimate_uses_one_h200s_measured_rates():
    from hs_dataset.write.plan import MEASURED_RATES, BuildPlan, estimate_rate
    from hs_dataset.cli.plan import _rate_line

    # the rates are the plain-prefill rows of the H200 benchmark results kept in the repository
    results = ROOT / "benchmarks" / "results"
    measured = {json.loads((results / f).read_text())["plain_tok_s"] for f in
                ("2026-12-01-h200-kimi-width-run2.json", "2026-12-01-h200-llama8b-384.json")}
    assert {r.tokens_per_second for r in MEASURED_RATES} == measured
    kimi_rate = next(r.tokens_per_second for r in MEASURED_RATES if r.hidden_size == 7168)
    llama_rate = next(r.tokens_per_second for r in MEASURED_RATES if r.hidden_size == 4096)
    kimi = ModelInfo("/m", None, "KimiK25ForConditionalGeneration", 7168, 61, 163840)
    rate, ref = estimate_rate(kimi)
    assert rate == pytest.approx(kimi_rate * 6 / 61) and ref.gpu == "H200"
    plan = BuildPlan(None, kimi, (3, 31, 59), 0, 0)  # type: ignore[arg-type]
    _, text = _rate_line(plan, None)
    assert "one H200's measured plain prefill" in text and "scaled by depth 6 -> 61" in text
    llama = ModelInfo("/m", None, "LlamaForCausalLM", 4096, 32, 128256)
    assert estimate_rate(llama)[0] == llama_rate
    assert estimate_rate(ModelInfo("/m", None, "X", 64, 4, 100)) is None


# ------------------------------------------------------------------ 4. builds that produce nothing usable
def test_a_build_that_writes_nothing_fails_with_the_breakdown(tiny_model, tmp_path):
    src = _write_rows(tmp_path / "text.jsonl", [{"text": f"row {i}"} for i in range(5)])
    out = tmp_path / "out"
    r = run("build", *demo(tiny_model, "--source", str(src)), "-o", str(out))
    user_error(r, "no sample was written", "all 5 samples were rejected", "Fix the source")
    assert "found keys ['text']" in r.stderr  # the breakdown, above the error line
    assert not (out / META_FILE).exists()


def test_too_many_rejects_fail_unless_accepted(tiny_model, mixed, tmp_path):
    out = tmp_path / "out"
    r = run("build", *demo(tiny_model, "--source", str(mixed)), "-o", str(out))
    user_error(r, "6 of 16 samples rejected (38%)", "--max-reject-rate 0.1", "--max-reject-rate 0.38")
    assert "found keys ['text']" in r.stderr
    r = run("build", *demo(tiny_model, "--source", str(mixed)), "-o", str(out), "--max-reject-rate", "0.38")
    assert r.returncode == 0 and "4 already done" in r.stdout and "found keys ['text']" in r.stdout, r.stderr


def test_lowering_max_samples_is_refused_unless_allowed(tiny_model, copy):
    shards = sorted(p.name for p in (copy / "data").iterdir())
    r = run("build", *demo(tiny_model, "--max-samples", "8"), "-o", str(copy))
    user_error(r, "holds 16 source rows, this build 8", "--allow-shrink")
    assert sorted(p.name for p in (copy / "data").iterdir()) == shards and (copy / META_FILE).exists()
    r = run("build", *demo(tiny_model, "--max-samples", "8"), "-o", str(copy), "--allow-shrink")
    assert r.returncode == 0 and "8 samples written" in r.stdout, r.stderr[-3000:]
    # a finished build's summary is the last thing it prints (duplicates first): a user reads the end
    assert r.stdout.strip().splitlines()[-1].startswith(f"built {copy}: 8 samples written"), r.stdout[-2000:]
    assert "duplicates: " in r.stdout and "Traceback" not in r.stdout + r.stderr


# ------------------------------------------------------------------ 5. inspect
def test_inspect_shows_the_data_and_plots_it(built, tmp_path):
    png = tmp_path / "demo.png"
    r = run("inspect", str(built[0]), "--plot", str(png))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    out = r.stdout
    assert "4 shards, 16 rows: all match hs_dataset.json (quick check)" in out
    assert "rejects:   none (of 16 samples)" in out and re.search(r"loss mask: \d+\.\d% of tokens", out)
    assert re.search(r"^lengths: +min \d+, median \d+", out, re.M)
    assert "states:    every value, counted while the build wrote it (bfloat16)" in out
    for col in ("hidden_layer_0", "hidden_layer_1", "hidden_layer_2", "hidden_final"):  # mean std absmax NaN Inf ...
        assert re.search(rf"^ +{col} +-?[\d.e-]+ +[\d.e-]+ +[\d.e-]+ +0 +0 +0\.00% +[\d.e-]+$", out, re.M), col
    assert "duplicates: none" in out and "flagged:   0 rows" in out and "probe:     not run" in out
    assert "schema:" not in out and "schema:" in run("inspect", str(built[0]), "--schema").stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_inspect_into_a_closed_pipe(built):
    proc = subprocess.Popen([sys.executable, "-m", "hs_dataset.cli", "inspect", str(built[0])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # like `| head` that has already exited
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "BrokenPipe" not in err and "Traceback" not in err, err
    r = subprocess.run(f"{sys.executable} -m hs_dataset.cli inspect {built[0]} | head -n 2", shell=True,
                       capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("dataset:") and r.stdout.count("\n") == 2 and "Error" not in r.stderr, r.stderr


# ------------------------------------------------------------------ 6. push and versions
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_push_without_a_token_says_how_to_get_one_before_any_work(tmp_path):
    with running_hub(tmp_path) as hub:
        env = client_subprocess_env(hub, tmp_path / "home")  # no token anywhere
        r = run("push", str(tmp_path / "not-even-a-build"), REPO, "--version", "v1.0", env=env)
    user_error(r, "no Hugging Face token: set HF_TOKEN or run `hf auth login`", cmd="push")


BAD_VERSIONS = {  # the spelling on the command line: words of the rule the one line must name
    "--version -v1": ["invalid version name '-v1'", "starts with '-'"],
    "--version=-v1": ["invalid version name '-v1'", "starts with '-'"],
    "--version 50d617e": ["invalid version name '50d617e'", "commit id"],
    "--version pr/1": ["invalid version name 'pr/1'", "refs/pr/N"],
    "--version " + "v" * 300: ["invalid version name '" + "v" * 40 + "'...", "300 characters long: at most 128"],
}


@pytest.mark.parametrize("spelling", list(BAD_VERSIONS), ids=lambda v: v[:20])
def test_a_bad_version_name_is_its_rule_in_one_line_before_anything_else(spelling, tmp_path):
    """Even ``--version -v1``, which argparse alone reads as an option, and before the token is asked for."""
    with running_hub(tmp_path) as hub:
        env = client_subprocess_env(hub, tmp_path / "home")  # no token: that error would come first otherwise
        r = run("push", str(tmp_path / "not-even-a-build"), REPO, *spelling.split(), env=env)
    user_error(r, *BAD_VERSIONS[spelling], "Use a plain tag name such as 'v1.0'", cmd="push")
    assert r.stderr.count("\n") == 1 and "usage:" not in r.stderr


def test_only_a_version_value_after_the_command_is_rejoined():
    assert dash_version(["push", "d", "r", "--version", "-v1"]) == ["push", "d", "r", "--version=-v1"]
    assert dash_version(["build", "s.py", "-o", "x", "--version", "-v1", "--push", "r"]) == [
        "build", "s.py", "-o", "x", "--version=-v1", "--push", "r"]
    for argv in (["--version"], ["push", "d", "r", "--version", "--force"], ["push", "d", "r", "--version", "-h"],
                 ["push", "d", "r", "--", "--version", "-v1"], ["push", "d", "r", "--version", "v1"]):
        assert dash_version(argv) == argv
    r = run("push", "d", REPO, "--version", "--force")  # a forgotten value is still argparse's error
    assert r.returncode == 2 and "argument --version: expected one argument" in r.stderr


def test_an_unreachable_endpoint_names_hf_endpoint(copy, tmp_path):
    with running_hub(tmp_path) as hub:
        env = client_subprocess_env(hub, tmp_path / "home", token=TOKEN)
    endpoint = f"http://127.0.0.1:{_free_port()}"
    env["HF_ENDPOINT"] = endpoint
    user_error(run("push", str(copy), REPO, "--version", "v1.0", env=env), f"cannot reach {endpoint}",
               "check HF_ENDPOINT", cmd="push")
    user_error(run("versions", REPO, env=env), f"cannot reach {endpoint}", "check HF_ENDPOINT", cmd="versions")


def test_a_refused_token_is_one_line(copy, tmp_path):
    with running_hub(tmp_path, write_token=TOKEN) as hub:
        env = client_subprocess_env(hub, tmp_path / "home", token="hf_NotTheRightToken000000000000000000")
        r = run("push", str(copy), REPO, "--version", "v1.0", env=env)
    last = user_error(r, "401", "set HF_TOKEN or run `hf auth login`", cmd="push")
    assert "hf_NotTheRightToken" not in r.stderr + r.stdout and "NotTheRight" not in last


def test_push_and_versions_print_readable_summaries(built, tmp_path):
    meta = json.loads((built[0] / META_FILE).read_text())
    with running_hub(tmp_path, write_token=TOKEN) as hub:
        env = client_subprocess_env(hub, tmp_path / "home", token=TOKEN)
        r = run("push", str(built[0]), REPO, "--version", "v1.0", env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        commit = hub.commit_of("dataset", REPO, "v1.0").oid
        v = run("versions", REPO, env=env)
        j = run("versions", REPO, "--format", "json", env=env)
    assert "PushResult(" not in r.stdout and f"as {REPO} v1.0 (tag at commit {commit[:12]})" in r.stdout
    assert v.returncode == 0 and "VersionInfo(" not in v.stdout, v.stderr[-3000:]
    header, row = v.stdout.splitlines()[1:3]
    assert header.split() == ["version", "commit", "rows", "tokens", "rejected", "size", "pushed", "(UTC)"]
    cells = row.split()
    assert cells[:5] == ["v1.0", commit[:12], "16", f"{meta['counts']['tokens_written']:,}", "0"]
    assert re.match(r"\d{4}-\d\d-\d\d", cells[-2])
    (entry,) = json.loads(j.stdout)
    assert (entry["version"], entry["commit_sha"], entry["samples"]) == ("v1.0", commit, 16)


def test_a_finished_push_run_again_exits_0_in_one_line_and_other_content_is_refused(tmp_path):
    build = write_built_dataset(tmp_path / "b", make_rows(5))
    with running_hub(tmp_path, write_token=TOKEN) as hub:
        env = client_subprocess_env(hub, tmp_path / "home", token=TOKEN)
        first = run("push", str(build), REPO, "--version", "v1.0", env=env)
        assert first.returncode == 0, first.stderr[-3000:]
        commit = hub.commit_of("dataset", REPO, "v1.0").oid
        before = hub.dump_state()
        again = run("push", str(build), REPO, "--version", "v1.0", env=env)
        assert hub.dump_state() == before
        other = run("push", str(write_built_dataset(tmp_path / "o", make_rows(5, seed=3))), REPO, "--version", "v1.0",
                    env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines() == [f"{REPO} v1.0 is already there with exactly this build (tag at commit "
                                         f"{commit[:12]}) on {hub.endpoint}: nothing uploaded"]
    user_error(other, "version tag 'v1.0' already exists", "holds other files than this build", "--force", cmd="push")


# ------------------------------------------------------------------ 7. progress
def test_progress_in_a_log_is_plain_lines_and_no_progress_is_silent(built, tiny_model, tmp_path):
    err = built[1].stderr  # the fixture's build, stderr to a pipe
    assert "\r" not in err and "\x1b" not in err
    assert [line for line in err.splitlines() if line.strip()] == [
        line for line in err.splitlines() if re.match(r"hs-dataset build: part \d of 4 committed, ", line)]
    r = run("build", *demo(tiny_model, "--max-samples", "4"), "-o", str(tmp_path / "quiet"), "--no-progress")
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]


def test_a_terminal_gets_one_bar_and_no_loading_bars(tiny_model, tmp_path):
    status, err = on_a_terminal(["build", *demo(tiny_model, "--max-samples", "8"), "-o", str(tmp_path / "out")])
    assert status == 0, err[-3000:]
    pieces = [p.strip() for p in re.split(r"[\r\n]+", err) if p.strip() and not set(p.strip()) <= {"\x1b[A"}]
    assert pieces and all(p.startswith("hs-dataset build:") for p in pieces), pieces  # one bar, nothing else
    assert "8/8" in pieces[-1]


# ------------------------------------------------------------------ 8. the demo's model
def test_the_demo_makes_its_model_only_in_its_own_cache(tmp_path):
    env = dict(os.environ, HS_DATASET_CACHE=str(tmp_path / "cache"))
    typo = tmp_path / "modles" / "llama"
    r = run("plan", SCRIPT, "--model", str(typo), "--max-samples", "2", env=env, timeout=600)
    user_error(r, "no config.json in model directory", "hs_dataset never downloads models", cmd="plan")
    assert not typo.exists()
    r = run("plan", SCRIPT, "--max-samples", "2", env=env, timeout=600)
    assert r.returncode == 0 and (tmp_path / "cache" / "tiny-demo-llama" / "config.json").exists(), r.stderr
