"""Faults end cleanly (issue 5): bad input, NaN/Inf states, a dying or hanging backend, a full or
unwritable disk. Each is named, leaves no corrupt output, and a rerun resumes."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hs_dataset.write.builder import NonFiniteError
from hs_dataset.write.driver import STATE_DIR, build
from hs_dataset.capture.backends import make_backend
from hs_dataset.capture.transformers import TransformersBackend
from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import BackendError, ConfigMismatchError, EmptyBuildError, OutputWriteError
from hs_dataset.prepare.conversations import parse_row
from hs_dataset.prepare.loss_mask import tokenize_sample
from hs_dataset.prepare.sources import iter_source
from hs_dataset.prepare.tokenizer import load_tokenizer
from hs_dataset.read.iterate import iter_torch
from tests.fixtures.builds import config, content_hash
from tests.fixtures.builds import load_built as load

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "builder_scripts" / "tiny_demo.py"
DEMO = ROOT / "builder_scripts" / "data" / "demo_conversations.jsonl"
LAYERS = (0, 1, 2)


def records(out: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((out / STATE_DIR / "parts").glob("part-*.json"))}


def assert_clean_stop(out: Path) -> int:
    """After a failed build: only whole, recorded shards in data/, no finished marker, no staging.
    Returns the number of recorded parts."""
    recs = records(out)
    listed = sorted(f["name"] for r in recs.values() for f in r["files"])
    shards = sorted(p.name for p in (out / "data").iterdir())
    assert shards == listed, "a shard of an unfinished part is visible"
    for name in shards:
        with pa.memory_map(str(out / "data" / name)) as src:
            pa.ipc.open_stream(src).read_all()
    assert not (out / "hs_dataset.json").exists()
    assert not (out / STATE_DIR / "staging").exists()
    assert not list(out.rglob("*.tmp-*"))
    return len(recs)


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging forever) when the block takes longer than ``seconds``."""
    def on_alarm(*_):
        raise TimeoutError(f"hang: still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------------------------
# NaN / Inf in captured states: a real model whose embedding rows are poisoned in the checkpoint
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def poisoned(tiny_model, tmp_path_factory):
    """A copy of the tiny model with token A's embedding row NaN and token B's +Inf: every sample
    holding A or B really produces non-finite states (no mock). Returns (dir, bad sample ids)."""
    from safetensors.torch import load_file, save_file

    tok = load_tokenizer(tiny_model)
    samples = [tokenize_sample(parse_row(r), tok, max_length=256) for r in iter_source(str(DEMO), stop=24)]
    where: dict[int, set[str]] = {}
    for s in samples:
        for t in set(s.input_ids.tolist()):
            where.setdefault(t, set()).add(s.sample_id)
    rare = sorted((t for t, ids in where.items() if 2 <= len(ids) <= 3), key=lambda t: (-len(where[t]), t))
    nan_tok = rare[0]
    inf_tok = next(t for t in rare if not where[t] & where[nan_tok])
    d = tmp_path_factory.mktemp("poisoned") / "model"
    shutil.copytree(tiny_model, d)
    weights = load_file(str(d / "model.safetensors"))
    weights["model.embed_tokens.weight"][nan_tok] = float("nan")
    weights["model.embed_tokens.weight"][inf_tok] = float("inf")
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    bad = [s.sample_id for s in samples if s.sample_id in where[nan_tok] | where[inf_tok]]
    return str(d), bad


def test_nonfinite_states_stop_the_build_naming_sample_and_layer(poisoned, tmp_path):
    model, bad = poisoned
    out = tmp_path / "out"
    with pytest.raises(NonFiniteError) as e:  # raised as itself, not wrapped by datasets
        build(config(model), out, progress=False)
    msg = str(e.value)
    assert repr(bad[0]) in msg and "hidden_layer_0" in msg and "NaN" in msg and "on_nonfinite=reject" in msg
    first_bad_part = int(bad[0].rsplit(":", 1)[1]) // 4
    assert assert_clean_stop(out) == first_bad_part  # the parts before it are kept, that part is not
    # what the message suggests works on the same directory: fail -> reject resumes (the parts written
    # under "fail" hold no non-finite state), and the result is the uninterrupted "reject" build
    s = build(config(model, on_nonfinite="reject"), out, progress=False)
    assert s.parts_skipped == first_bad_part and s.counts.rejected == len(bad)
    ref = tmp_path / "ref"
    build(config(model, on_nonfinite="reject"), ref, progress=False)
    assert content_hash(out) == content_hash(ref)
    assert (out / "rejects.jsonl").read_text() == (ref / "rejects.jsonl").read_text()
    with pytest.raises(ConfigMismatchError, match="on_nonfinite"):  # reject -> fail is refused
        build(config(model), out, progress=False)


def test_nonfinite_states_rejected_by_name_and_the_rest_exact(poisoned, tiny_model, tmp_path):
    model, bad = poisoned
    out, clean = tmp_path / "out", tmp_path / "clean"
    s = build(config(model, on_nonfinite="reject"), out, progress=False)
    assert (s.counts.samples_in, s.counts.rejected, s.counts.written) == (24, len(bad), 24 - len(bad))
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert [r["sample_id"] for r in rejects] == bad
    assert all(r["field"] == "hidden_layer_0" and "non-finite" in r["reason"] and r["stage"] == "encode"
               for r in rejects)
    meta = json.loads((out / "hs_dataset.json").read_text())
    assert meta["counts"]["rejects_by_stage"] == {"encode": len(bad)}
    # every other sample is bit-identical to the clean model's: NaN never leaks across a batch
    build(config(tiny_model), clean, progress=False)
    ref = {r["id"]: r for r in iter_torch(load(clean))}
    rows = list(iter_torch(load(out)))
    assert {r["id"] for r in rows} == set(ref) - set(bad)
    for r in rows:
        for c in ("hidden_layer_0", "hidden_layer_2", "hidden_final"):
            assert torch.equal(r[c].view(torch.int16), ref[r["id"]][c].view(torch.int16))


def test_cli_on_nonfinite_flag(poisoned, tmp_path):
    """`hs-dataset build --on-nonfinite reject` (the default, fail, is tested in-process above)."""
    model, bad = poisoned
    common = [sys.executable, "-m", "hs_dataset.cli", "build", str(SCRIPT), "--set", f"model={model}",
              "--set", "max_samples=24", "--set", "max_length=256", "--no-progress"]
    r = subprocess.run(common + ["-o", str(tmp_path / "a"), "--on-nonfinite", "reject", "--max-reject-rate", "0.5"],
                       capture_output=True, text=True, timeout=300)  # a quarter of the samples are poisoned on purpose
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{24 - len(bad)} samples written, {len(bad)} rejected" in r.stdout
    assert json.loads((tmp_path / "a" / "hs_dataset.json").read_text())["config"]["on_nonfinite"] == "reject"


# ------------------------------------------------------------------------------------------------
# the capture backend dies or hangs (isolated in a child process)
# ------------------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _backend_children() -> set[int]:
    """Live (not zombie) spawned children of this process: isolated backends."""
    me, kids = os.getpid(), set()
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                state, ppid = (p / "stat").read_text().rsplit(")", 1)[1].split()[:2]
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if int(ppid) == me and state != "Z" and b"spawn_main" in cmd:
                kids.add(int(p.name))
    return kids


def _when_parts_recorded(out: Path, n: int, action, limit: float = 120) -> threading.Thread:
    fired: list[float] = []

    def run():
        t = time.monotonic()
        while len(list((out / STATE_DIR / "parts").glob("part-*.json"))) < n:
            if time.monotonic() - t > limit:
                return
            time.sleep(0.002)
        time.sleep(0.03)  # into the next part
        action()
        fired.append(time.monotonic())

    th = threading.Thread(target=run, daemon=True)
    th.fired = fired
    th.start()
    return th


IN_PROCESS = {"device": "cpu", "batch_tokens": 512}
ISOLATED = dict(IN_PROCESS, isolate=True, timeout=30, max_inflight=4)


def test_backend_process_killed_mid_build_stops_cleanly_and_resumes(tiny_model, tmp_path):
    cfg = config(tiny_model, max_samples=48, backend_options=ISOLATED)
    out = tmp_path / "out"
    before = _backend_children()
    pb = make_backend(cfg.backend, cfg.model, cfg.layers, options=cfg.backend_options)
    try:
        killer = _when_parts_recorded(out, 2, lambda: os.kill(pb.pid, signal.SIGKILL))
        with deadline(120), pytest.raises(BackendError) as e:
            build(cfg, out, backend=pb, progress=False)
        stopped = time.monotonic()
        killer.join()
        assert killer.fired and stopped - killer.fired[0] < 60
        print(f"\nbackend killed -> build stopped in {stopped - killer.fired[0]:.2f} s")
    finally:
        t = time.monotonic()
        pb.close()
        assert time.monotonic() - t < 15
    msg = str(e.value)
    assert f"pid {pb.pid}" in msg and "SIGKILL" in msg and "run the same command again" in msg.lower()
    done = assert_clean_stop(out)
    assert 2 <= done < 12
    s = build(cfg, out, progress=False)  # the same configuration: a fresh isolated backend, resumed
    assert (s.parts_skipped, s.parts_built) == (done, 12 - done)
    ref = tmp_path / "ref"  # in-process, same batching: isolation changes no bit
    build(config(tiny_model, max_samples=48, backend_options=IN_PROCESS), ref, progress=False)
    assert content_hash(out) == content_hash(ref)
    assert _backend_children() - before == set()  # no orphan backend process


def test_backend_process_hang_stops_within_the_timeout(tiny_model, tmp_path):
    timeout = 3
    cfg = config(tiny_model, max_samples=48, backend_options=dict(ISOLATED, timeout=timeout))
    out = tmp_path / "out"
    before = _backend_children()
    stopped_pids: list[int] = []

    def stop_child():  # the build started its own isolated backend: find it among our children
        for pid in _backend_children() - before:
            os.kill(pid, signal.SIGSTOP)
            stopped_pids.append(pid)

    killer = _when_parts_recorded(out, 1, stop_child)
    try:
        with deadline(120), pytest.raises(BackendError) as e:
            build(cfg, out, progress=False)
        stopped = time.monotonic()
        killer.join()
        assert stopped_pids and killer.fired
        took = stopped - killer.fired[0]
        print(f"\nbackend stopped (SIGSTOP) -> build stopped in {took:.2f} s (timeout {timeout} s)")
        assert timeout - 0.5 <= took < timeout + 10
    finally:
        for pid in stopped_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert "hangs" in str(e.value) and f"{timeout} s" in str(e.value) and "resume" in str(e.value)
    assert not any(_alive(pid) for pid in stopped_pids)  # it was killed, not left stopped
    done = assert_clean_stop(out)
    s = build(cfg, out, backend=TransformersBackend(tiny_model, LAYERS, **IN_PROCESS), progress=False)
    assert s.parts_skipped == done and s.counts.written == 48


def test_killing_the_build_also_ends_its_isolated_backend(tiny_model, tmp_path):
    """SIGKILL of `hs-dataset build` leaves no orphan backend process holding the accelerator."""
    out = tmp_path / "out"
    proc = subprocess.Popen(["hs-dataset", "build", str(SCRIPT), "-o", str(out), "--no-progress",
                             "--set", f"model={tiny_model}", "--set", "backend_options.isolate=true"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def backend_child() -> int | None:
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                with contextlib.suppress(OSError):
                    if (int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == proc.pid
                            and b"spawn_main" in (p / "cmdline").read_bytes()):
                        return int(p.name)
        return None

    try:
        t = time.monotonic()
        while (child := backend_child()) is None or not (out / STATE_DIR / "parts").exists():
            assert proc.poll() is None and time.monotonic() - t < 120
            time.sleep(0.01)
        proc.kill()
        proc.wait()
        t = time.monotonic()
        while _alive(child):
            assert time.monotonic() - t < 10, "the backend process outlived the build"
            time.sleep(0.01)
    finally:
        proc.kill()


def test_backend_start_failure_is_reported_from_the_child(tiny_model, tmp_path):
    with pytest.raises(BackendError, match="failed to start") as e:
        make_backend("transformers", tiny_model, LAYERS, options={"isolate": True, "device": "no-such-device"})
    assert "no-such-device" in str(e.value)


# ------------------------------------------------------------------------------------------------
# disk full, unwritable output
# ------------------------------------------------------------------------------------------------


def _sets(model: str) -> list[str]:
    return [f"model={model}", "max_samples=32", "max_length=256", "part_size=4"]


def _cli(out: Path, model: str) -> list[str]:
    return ["hs-dataset", "build", str(SCRIPT), "-o", str(out), "--no-progress",
            *sum((["--set", x] for x in _sets(model)), [])]


def _cli_config(model: str) -> HiddenStatesConfig:
    """The configuration `hs-dataset build` makes of the same command line."""
    from hs_dataset.cli import load_preset

    return HiddenStatesConfig(**load_preset(str(SCRIPT), _sets(model)))


def test_file_size_limit_stops_cleanly_and_resumes(tiny_model, tmp_path):
    """Disk full without root: the build runs under RLIMIT_FSIZE with SIGXFSZ ignored, so writing
    past the limit fails with EFBIG like a full disk fails with ENOSPC."""
    ref = tmp_path / "ref"
    build(_cli_config(tiny_model), ref, progress=False)
    sizes = [r["files"][0]["bytes"] for r in records(ref).values()]
    limit = max(sizes[:2]) + 1
    first_fail = next(i for i, b in enumerate(sizes) if b > limit)
    assert first_fail >= 2

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    out = tmp_path / "out"
    r = subprocess.run(_cli(out, tiny_model), capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert r.returncode == 2 and "Traceback" not in r.stderr  # a user-fixable error: one line, exit 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("hs-dataset build: error: cannot write")
    assert str(out) in last and "File too large" in last and "run the same command again" in last
    assert assert_clean_stop(out) == first_fail
    s = build(_cli_config(tiny_model), out, progress=False)  # what the same command does without the limit
    assert (s.parts_skipped, s.parts_built) == (first_fail, 8 - first_fail)
    assert content_hash(out) == content_hash(ref)


def test_a_failed_background_write_leaves_nothing_queued_for_the_rerun(tiny_model, tmp_path):
    """In this process, as a script or a notebook runs it: shard writes run behind the capture
    (hs_dataset.write.native_files), so a full disk can surface at a part's commit while the next part is
    already generated. The failed build lets go of every file it had open; the rerun in the same process,
    with room again, resumes to the uninterrupted build's bytes."""
    from hs_dataset.write import native_files

    ref = tmp_path / "ref"
    build(_cli_config(tiny_model), ref, progress=False)
    sizes = [r["files"][0]["bytes"] for r in records(ref).values()]
    limit = max(sizes[:2]) + 1
    out = tmp_path / "out"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(OutputWriteError, match="File too large"):
            build(_cli_config(tiny_model), out, progress=False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert not native_files._files  # nothing of the failed build is still queued or open
    done = assert_clean_stop(out)
    s = build(_cli_config(tiny_model), out, progress=False)
    assert s.parts_skipped == done and content_hash(out) == content_hash(ref)


@contextlib.contextmanager
def _mounted(target: Path, *args: str):
    target.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", *args, str(target)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount here ({r.stderr.strip()[:200]})")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def test_full_disk_stops_cleanly_and_resumes(tiny_model, backend, tmp_path):
    """A real ENOSPC: a 1 MiB tmpfs (needs root; skipped elsewhere), grown after the failure."""
    ref = tmp_path / "ref"
    build(config(tiny_model, max_samples=32), ref, backend=backend, progress=False)
    with _mounted(tmp_path / "small", "-t", "tmpfs", "-o", "size=1m", "tmpfs") as disk:
        out = disk / "out"
        with pytest.raises(OutputWriteError) as e:
            build(config(tiny_model, max_samples=32), out, backend=backend, progress=False)
        assert e.value.errno == 28 and "No space left on device" in str(e.value) and str(out) in str(e.value)
        done = assert_clean_stop(out)
        assert 0 < done < 8
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        s = build(config(tiny_model, max_samples=32), out, backend=backend, progress=False)
        assert s.parts_skipped == done
        assert content_hash(out) == content_hash(ref)


def test_unwritable_output_is_named(tiny_model, backend, tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("not a directory")
    for out in (afile / "out", afile):
        with pytest.raises(OutputWriteError) as e:
            build(config(tiny_model), out, backend=backend, progress=False)
        assert f"{afile} is a file, not a directory" in str(e.value) and "--output" in str(e.value)
    assert afile.read_text() == "not a directory"


def test_read_only_output_is_named_and_resumes(tiny_model, backend, tmp_path):
    """A read-only bind mount (needs root; skipped elsewhere): root ignores permission bits."""
    d = tmp_path / "ro"
    with _mounted(d, "--bind", str(tmp_path / "ro")):
        build(config(tiny_model, max_samples=8), d / "out", backend=backend, progress=False)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(d)], check=True)
        with pytest.raises(OutputWriteError) as e:
            build(config(tiny_model, max_samples=24), d / "out", backend=backend, progress=False)
        assert e.value.errno == 30 and "Read-only file system" in str(e.value) and str(d / "out") in str(e.value)
        subprocess.run(["mount", "-o", "remount,bind,rw", str(d)], check=True)
        s = build(config(tiny_model, max_samples=24), d / "out", backend=backend, progress=False)
        assert (s.parts_skipped, s.counts.written) == (2, 24)


# ------------------------------------------------------------------------------------------------
# malformed input through the whole build (property-based)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def picky_tokenizer(tiny_model, tmp_path_factory) -> str:
    """The tiny tokenizer with a chat template that raises on content containing 'BOOM'."""
    d = tmp_path_factory.mktemp("picky")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(tiny_model) / f, d / f)
    t = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").write_text(
        "{%- for m in messages %}{%- if 'BOOM' in m['content'] %}{{ raise_exception('template refuses BOOM') }}"
        "{%- endif %}{%- endfor %}" + t)
    return str(d)


words = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12)
texts = st.lists(words, min_size=1, max_size=6).map(" ".join).filter(lambda s: s.strip())
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=False), words)
any_json = st.recursive(json_scalars, lambda c: st.one_of(st.lists(c, max_size=3),
                                                          st.dictionaries(words, c, max_size=3)), max_leaves=8)
VOCAB = 1536  # the tiny tokenizer's size (checked in the test)


@st.composite
def conversation(draw, key=None):
    key = key or draw(st.sampled_from(["conversations", "messages"]))
    rk, ck = ("from", "value") if key == "conversations" else ("role", "content")
    names = {"user": ["user", "human", "User"], "assistant": ["assistant", "gpt", "model"]}
    if key == "messages":
        names = {"user": ["user"], "assistant": ["assistant"]}
    turns = []
    if draw(st.booleans()):
        turns.append({rk: "system", ck: draw(texts)})
    for _ in range(draw(st.integers(1, 3))):
        turns.append({rk: draw(st.sampled_from(names["user"])), ck: draw(texts)})
        turns.append({rk: draw(st.sampled_from(names["assistant"])), ck: draw(texts)})
    return {key: turns, "id": draw(words)}


@st.composite
def malformed(draw):
    """(line bytes, expected: None = may be written or rejected, else (field prefix, reason part), kind)."""
    kind = draw(st.sampled_from(["valid", "long", "empty", "role", "order", "missing", "type", "surrogate",
                                 "boom", "tokens", "oov", "mask", "shape", "utf8", "notjson", "blank", "any"]))
    conv = draw(conversation())
    key = next(k for k in ("conversations", "messages") if k in conv)
    rk, ck = ("from", "value") if key == "conversations" else ("role", "content")
    turns = conv[key]
    expect = None
    if kind == "long":
        turns[-1][ck] = " ".join(draw(texts) for _ in range(60))
    elif kind == "empty":
        conv[key], expect = [], (key, "empty")
    elif kind == "role":
        i = draw(st.integers(0, len(turns) - 1))
        turns[i][rk] = draw(st.one_of(st.sampled_from(["wizard", "tool", "", "bot"]), st.integers(), st.none()))
        expect = (f"{key}[", "")
    elif kind == "order":
        draw(st.randoms()).shuffle(turns)
        turns.append(dict(turns[-1]))  # two identical turns in a row: never alternating
        expect = (key, "")
    elif kind == "missing":
        i = draw(st.integers(0, len(turns) - 1))
        del turns[i][draw(st.sampled_from([rk, ck]))]
        expect = (f"{key}[{i}].", "missing field")
    elif kind == "type":
        i = draw(st.integers(0, len(turns) - 1))
        turns[i][ck] = draw(st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(),
                                      st.dictionaries(words, words, min_size=1, max_size=2),
                                      st.lists(st.integers(), min_size=1, max_size=2)))
        expect = (f"{key}[", "")
    elif kind == "surrogate":
        turns[-1][ck] = draw(texts) + draw(st.sampled_from(["\ud800", "\udfff", "\udc80x"]))
        expect = (f"{key}[", "UTF-8")
    elif kind == "boom":
        turns[-1][ck] += " BOOM"
        expect = ("chat_template", "BOOM")
    elif kind in ("tokens", "oov", "mask"):
        ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40))
        conv = {"input_ids": ids}
        if kind == "oov":
            j = draw(st.integers(0, len(ids) - 1))
            ids[j] = draw(st.integers(VOCAB, 2**40))
            expect = ("input_ids[", "")
        elif kind == "mask":
            conv["loss_mask"] = draw(st.lists(st.integers(0, 2), max_size=45))
    elif kind == "shape":
        conv = draw(st.one_of(any_json.filter(lambda v: not isinstance(v, dict)),
                              st.just({"conversations": turns, "messages": turns}),
                              st.dictionaries(words.filter(lambda k: k not in ("conversations", "messages",
                                                                               "input_ids")), any_json)))
        expect = ("row", "")
    elif kind == "any":
        conv = {draw(st.sampled_from(["conversations", "messages", "input_ids"])): draw(any_json)}
    if kind == "utf8":
        raw = draw(st.binary(min_size=1, max_size=30).filter(lambda b: b"\n" not in b))
        return b'{"messages": "' + raw + b'\xff"}', ("row", "UTF-8"), kind
    if kind == "notjson":
        return draw(words.filter(lambda w: "\n" not in w and "\r" not in w)).encode() + b" {", ("row", "JSON"), kind
    if kind == "blank":
        return b"", ("row", "blank"), kind
    return json.dumps(conv).encode(), expect, kind


@settings(max_examples=int(os.environ.get("HS_FAULT_EXAMPLES", 100)), deadline=None, derandomize=False,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(rows=st.lists(malformed(), min_size=1, max_size=12), max_length=st.sampled_from([16, 48, 256]),
       truncation=st.sampled_from(["truncate", "reject"]), mask=st.sampled_from(["all", "last"]),
       part_size=st.integers(1, 6))
def test_malformed_input_never_crashes_and_every_sample_is_accounted_for(
        backend, picky_tokenizer, tiny_model, rows, max_length, truncation, mask, part_size):
    assert len(load_tokenizer(picky_tokenizer)) == VOCAB
    work = Path(tempfile.mkdtemp(prefix="hs-malformed-"))
    try:
        src = work / "src.jsonl"
        src.write_bytes(b"".join(line + b"\n" for line, _, _ in rows))
        cfg = HiddenStatesConfig(model=tiny_model, tokenizer=picky_tokenizer, layers=LAYERS, source=str(src),
                                 max_length=max_length, truncation=truncation, mask=mask, part_size=part_size)
        with deadline(120):
            try:
                s = build(cfg, work / "out", backend=backend, progress=False)
            except EmptyBuildError:  # every sample rejected: nothing to load, rejects.jsonl says why
                s = None
        n = len(rows)
        rejects = [json.loads(x) for x in (work / "out" / "rejects.jsonl").read_text().splitlines()]
        if s is None:
            assert len(rejects) == n and not (work / "out" / "hs_dataset.json").exists()
        else:
            assert s.counts.samples_in == n == s.counts.written + s.counts.rejected
            assert len(rejects) == s.counts.rejected
        for r in rejects:
            assert r["sample_id"].startswith("src:") and r["field"] and r["reason"].strip() and r["stage"]
        rejected = {r["sample_id"]: r for r in rejects}
        written = []
        if s is not None and s.counts.written:
            written = list(load(work / "out")["id"])
        everyone = [f"src:{i}" for i in range(n)]
        assert sorted(written + list(rejected), key=everyone.index) == everyone  # each exactly once
        for i, (_, expect, _) in enumerate(rows):
            if expect is not None:
                r = rejected.get(f"src:{i}")
                assert r is not None, (i, rows[i])
                assert r["field"].startswith(expect[0]) and expect[1] in r["reason"], (r, rows[i])
        if s is not None:
            meta = json.loads((work / "out" / "hs_dataset.json").read_text())
            assert meta["counts"]["rejected"] == len(rejects)
            assert sum(meta["counts"]["rejects_by_stage"].values()) == len(rejects)
        _tried.update(kind for _, _, kind in rows)
        _tried["(builds)"] += 1
        _tried["(rejected)"] += len(rejects)
    finally:
        shutil.rmtree(work, ignore_errors=True)


_tried: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_tried():
    yield
    if _tried:
        print(f"\nmalformed-input cases tried through the build: {dict(sorted(_tried.items()))}")
