"""Crash-safe, resumable builds (issue 5): SIGKILL at random points, then the same command again.

The kill test runs the real ``hs-dataset build`` command line (``hs_dataset.cli.main``) in a child
process through a small tracing driver (this file run as a script): it logs each step the build
takes (part generation, every shard move into data/, every part record, every file written by the
final step) and sleeps 20 ms before the moves, records and final writes, so that random kills land
in those narrow windows too. The test kills the child with SIGKILL at random times and at random
steps, checks after each kill that the directory is consistent, and finally compares the finished
build row by row (content hash) with an uninterrupted build.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "builder_scripts" / "tiny_demo.py"
DEMO = ROOT / "builder_scripts" / "data" / "demo_conversations.jsonl"


# ------------------------------------------------------------------------------------------------
# the tracing driver (runs in the child process)
# ------------------------------------------------------------------------------------------------


def _driver(log: str, argv: list[str]) -> int:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def ev(text: str) -> None:
        os.write(fd, (text + "\n").encode())

    import hs_dataset.write.driver as B
    from hs_dataset import cli

    out = Path(argv[argv.index("-o") + 1]).absolute()
    real_replace = os.replace

    def replace(src, dst):
        d = Path(dst).absolute()
        step = {out / "data": "move", out / ".hs_build" / "parts": "record", out: "final"}.get(d.parent)
        if step is None:
            return real_replace(src, dst)
        ev(f"{step} {d.name}")
        time.sleep(0.02)
        real_replace(src, dst)
        ev(f"/{step} {d.name}")  # done: a kill after it did not land in this step (parts commit side by side)

    os.replace = replace
    real_finalize, real_recover = B.finalize, B.recover
    real_generate = B.generate_part

    def finalize(*a, **k):
        ev("finalize")
        return real_finalize(*a, **k)

    def recover(*a, **k):
        ev("recover")
        return real_recover(*a, **k)

    def generate(resolved, out, state, i, *a, **k):
        ev(f"gen part-{i:05d}")
        return real_generate(resolved, out, state, i, *a, **k)

    real_make_backend = B.make_backend

    def make_backend(*a, **k):
        ev("backend")
        return real_make_backend(*a, **k)

    B.finalize, B.make_backend, B.recover, B.generate_part = finalize, make_backend, recover, generate
    ev("start")
    rc = cli.main(argv)
    ev("done")
    return rc


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--kill-driver":
    sys.exit(_driver(sys.argv[2], sys.argv[3:]))

# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

import pyarrow as pa  # noqa: E402
import pytest  # noqa: E402

from hs_dataset.write.driver import STATE_DIR, build  # noqa: E402
from hs_dataset.cli import load_preset  # noqa: E402
from hs_dataset.config import HiddenStatesConfig  # noqa: E402
from hs_dataset.demo.tiny import make_tiny_model_dir  # noqa: E402
from hs_dataset.errors import BuildLockedError, ConfigMismatchError
from tests.fixtures.builds import config, content_hash  # noqa: E402
from tests.fixtures.builds import load_built as load

LAYERS = (0, 1, 2)
BAD_LINES = [
    '{"conversations": []}',
    '{"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}',
    "not json at all",
    '{"input_ids": [1, 2, 99999999]}',
    '{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}',
    '{"conversations": [{"from": "gpt", "value": "first"}, {"from": "human", "value": "q"}]}',
    '{"messages": [{"role": "user"}]}',
]


def mixed_source(path: Path, n_good: int = 64) -> Path:
    """Demo conversations with malformed rows mixed in (so that parts carry rejects too)."""
    lines = DEMO.read_text().splitlines()[:n_good]
    for k, bad in enumerate(BAD_LINES):
        lines.insert(5 + 9 * k, bad)
    path.write_text("\n".join(lines) + "\n")
    return path


def records(out: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((out / STATE_DIR / "parts").glob("part-*.json"))}


def check_consistent(out: Path) -> dict[str, int]:
    """What a reader of ``out`` may rely on at any moment, even right after a SIGKILL.

    Returns the mtime of every part record (to prove later that finished parts are not redone).
    """
    data = out / "data"
    shards = sorted(data.glob("train-*.arrow")) if data.exists() else []
    for f in shards:  # only whole shards are ever visible
        with pa.memory_map(str(f)) as src:
            pa.ipc.open_stream(src).read_all()
    recs = records(out) if (out / STATE_DIR / "parts").exists() else {}
    for r in recs.values():
        for f in r["files"]:
            p = data / f["name"]
            assert p.is_file() and p.stat().st_size == f["bytes"], (r["part"], f)
    if (out / "hs_dataset.json").exists():  # present only for a finished build, and then exact
        meta = json.loads((out / "hs_dataset.json").read_text())
        listed = sorted(f["name"] for r in recs.values() for f in r["files"])
        assert [f.name for f in shards] == listed
        assert meta["counts"]["samples_in"] == sum(r["stop"] - r["start"] for r in recs.values())
        assert (out / "README.md").exists() and (out / "rejects.jsonl").exists()
    return {name: (out / STATE_DIR / "parts" / name).stat().st_mtime_ns for name in recs}


def phase(events: list[str]) -> str:
    """Where a kill landed: in a shard move, a part record or a final write that had begun and not ended (parts
    commit on several threads, so the last event may be another thread's), else the last step begun."""
    begun = [e for e in events if not e.startswith("/")]
    open_ = set(begun) - {e[1:] for e in events if e.startswith("/")}
    for step in ("move", "record", "final"):
        if any(e.split()[0] == step for e in open_):
            return _phase_of(step)
    return _phase_of(begun[-1].split()[0]) if begun else "startup"


def _phase_of(word: str) -> str:
    return {"start": "startup", "recover": "recovery", "backend": "starting the backend", "gen": "generating a part", "move": "moving shards",
            "record": "writing a part record", "finalize": "finalize", "final": "finalize",
            "done": "after the end"}.get(word, word)


def test_kill_at_random_points_then_resume_gives_the_uninterrupted_rows(tiny_model, tmp_path):
    """13 SIGKILLs of `hs-dataset build` at random times and steps (part generation, shard moves,
    part records, the final step), with the shard size changing between runs (a performance knob);
    after each kill the directory is consistent, finished parts are never redone, and the last
    run's rows are identical to an uninterrupted build's."""
    src = mixed_source(tmp_path / "mixed.jsonl")  # 71 rows: 36 parts
    n_rows = len(src.read_text().splitlines())
    sets = [f"model={tiny_model}", f"source={src}", "part_size=2", "max_length=256", "writer_batch_bytes=1"]

    ref = tmp_path / "ref"
    ref_summary = build(HiddenStatesConfig(**load_preset(str(SCRIPT), sets)), ref, progress=False)
    assert ref_summary.counts.samples_in == n_rows and ref_summary.counts.rejected == len(BAD_LINES)

    out = tmp_path / "out"
    seed = int(os.environ.get("HS_KILL_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    plans: list[tuple] = [("time", "start", rng.uniform(0.3, 1.8)) for _ in range(2)]
    plans += [("time", "gen", rng.uniform(0, 0.8)) for _ in range(3)]
    plans += [("event", "move", rng.randint(1, 3)) for _ in range(3)]
    plans += [("event", "record", rng.randint(1, 3)) for _ in range(2)]
    plans += [("event", "gen", rng.randint(1, 4))]
    rng.shuffle(plans)
    plans += [("event", "finalize", 1), ("event", "final", rng.randint(1, 3))]
    landed: list[str] = []
    kept: dict[str, int] = {}
    log = tmp_path / "events.log"

    def run(shard_bytes: int) -> subprocess.Popen:
        log.unlink(missing_ok=True)
        argv = ["build", str(SCRIPT), "-o", str(out), "--no-progress", *sum((["--set", s] for s in sets), []),
                "--set", f"max_shard_bytes={shard_bytes}"]
        return subprocess.Popen([sys.executable, __file__, "--kill-driver", str(log), *argv],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def events() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    def wait_for(proc: subprocess.Popen, pred, limit: float = 120) -> bool:
        t = time.monotonic()
        while time.monotonic() - t < limit:
            if pred():
                return True
            if proc.poll() is not None:
                return False
            time.sleep(0.002)
        raise AssertionError("the build made no progress")

    for r, plan in enumerate(plans):
        proc = run(rng.choice([60_000, 150_000, 10**9]))
        try:
            if not wait_for(proc, lambda: "start" in events()):
                raise AssertionError("the build ended before it started")
            if plan[0] == "time":  # a random time after the build starts, or after its first part starts
                _, after, dt = plan
                wait_for(proc, lambda: after in {e.split()[0] for e in events()})
                # ... but after at most 2 (3) parts started, however fast this machine is: the 11 rounds
                # before the finalize ones then cannot finish the 36 parts (2*2 + 3*3 + 3*3 + 2*3 + 4 = 32)
                cap, until = (2 if after == "start" else 3), time.monotonic() + dt
                wait_for(proc, lambda: time.monotonic() >= until or
                         sum(e.split()[0] == "gen" for e in events()) >= cap)
            else:
                _, prefix, k = plan
                wait_for(proc, lambda: sum(e.split()[0] == prefix for e in events()) >= k)
                time.sleep(rng.uniform(0, 0.015))
            finished_first = proc.poll() is not None
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        ev = events()
        landed.append("after the end" if finished_first else phase(ev))
        print(f"round {r}: plan {plan}, killed at {ev[-1] if ev else None!r} -> {landed[-1]}, "
              f"{len(records(out))} parts recorded")
        now = check_consistent(out)
        for name, mtime in kept.items():  # finished parts are never redone
            assert now.get(name) == mtime, f"round {r}: {name} was redone or lost"
        kept = now
    print(f"\nkill seed {seed}; kills landed: {dict(Counter(landed))}")
    in_build = [p for p in landed if p not in ("startup", "after the end")]
    assert len(in_build) >= 10, landed
    assert {"moving shards", "finalize"} <= set(landed), landed

    proc = run(rng.choice([60_000, 10**9]))
    assert proc.wait(timeout=300) == 0
    check_consistent(out)
    assert all(records(out)[n] for n in kept)  # still there, untouched
    assert content_hash(out) == content_hash(ref)
    assert (out / "rejects.jsonl").read_text() == (ref / "rejects.jsonl").read_text()
    meta, ref_meta = (json.loads((d / "hs_dataset.json").read_text()) for d in (out, ref))
    assert meta["counts"] == ref_meta["counts"] and meta["counts"]["samples_in"] == n_rows
    ids = list(load(out)["id"])
    assert len(ids) == len(set(ids)) == ref_summary.counts.written  # no duplicated, no missing sample
    leftovers = sorted(p.name for p in out.rglob("*") if ".tmp-" in p.name or p.name.endswith(".incomplete"))
    assert leftovers == [] and not (out / STATE_DIR / "staging").exists()


def test_leftovers_of_a_killed_part_are_not_published_after_a_shard_size_change(tiny_model, tmp_path):
    """Regression: a killed run's shards stay in the part's staging folder; a rerun with a larger max_shard_bytes
    once moved those stale shards into data/ along with the new one (23 rows instead of 20, and load_dataset
    failed on the split sizes)."""
    out = tmp_path / "out"
    code = f"""
import os, signal
import hs_dataset.write.driver as B
from hs_dataset.config import HiddenStatesConfig
seen = [0]
row = B.BuildProgress.row
def kill_at_6(self, *a):
    row(self, *a)
    seen[0] += 1
    if seen[0] == 6:
        os.kill(os.getpid(), signal.SIGKILL)
B.BuildProgress.row = kill_at_6
cfg = HiddenStatesConfig(model={tiny_model!r}, layers=(0, 1, 2), source={str(DEMO)!r}, max_length=256, part_size=8,
                         max_samples=20, max_shard_bytes=100_000, writer_batch_bytes=1,
                         backend_options={{"device": "cpu"}})
B.build(cfg, {str(out)!r}, progress=False)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    stale = list((out / STATE_DIR / "staging").rglob("*.arrow"))
    assert len(stale) >= 2  # the killed part's shards
    s = build(config(tiny_model, part_size=8, max_samples=20, max_shard_bytes=10**9, writer_batch_bytes=1),
              out, progress=False)
    assert s.counts.written == 20
    ref = tmp_path / "ref"
    build(config(tiny_model, part_size=8, max_samples=20), ref, progress=False)
    assert load(out).num_rows == 20
    assert content_hash(out) == content_hash(ref)


@pytest.mark.parametrize("change", ["model", "layers", "storage_dtype", "source path", "source content"])
def test_a_changed_configuration_is_refused_not_mixed(tiny_model, backend, tmp_path, change):
    src = tmp_path / "src.jsonl"
    src.write_text("\n".join(DEMO.read_text().splitlines()[:12]) + "\n")
    out = tmp_path / "out"
    build(config(tiny_model, source=str(src)), out, backend=backend, progress=False)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "lock"}
    if change == "model":
        other = make_tiny_model_dir(tmp_path / "other-model", template="chatml", seed=1)
        cfg, field = config(str(other), source=str(src)), "model"
    elif change == "layers":
        cfg, field = config(tiny_model, source=str(src), layers=(0, 2)), "layers"
    elif change == "storage_dtype":
        cfg, field = config(tiny_model, source=str(src), storage_dtype="fp8_e4m3"), "storage_dtype"
    elif change == "source path":
        cfg, field = config(tiny_model, source=str(DEMO)), "source"
    else:
        src.write_text(src.read_text().replace("Paris", "Lyon"))
        cfg, field = config(tiny_model, source=str(src)), "source_fingerprint"
    with pytest.raises(ConfigMismatchError, match=field) as e:
        build(cfg, out, progress=False)
    assert "new --output directory" in str(e.value)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "lock"}
    assert after == before  # nothing touched


def test_damaged_resume_state_is_repaired_and_only_the_damaged_parts_redone(tiny_model, backend, tmp_path):
    from hs_dataset.write.resume import note_moving

    out, ref = tmp_path / "out", tmp_path / "ref"
    build(config(tiny_model), ref, backend=backend, progress=False)
    first = build(config(tiny_model), out, backend=backend, progress=False)
    assert first.parts_built == 6
    data, parts = out / "data", out / STATE_DIR / "parts"
    (data / "train-00001-000.arrow").unlink()                          # a record pointing at a missing shard
    with open(data / "train-00002-000.arrow", "r+b") as f:             # a shard cut short (size differs)
        f.truncate(1000)
    (parts / "part-00003.json").write_text('{"part": 3, "fil')         # a torn record
    note_moving(out / STATE_DIR, 4, ["train-00004-000.arrow"])         # moved, unrecorded (killed before the record):
    (parts / "part-00004.json").unlink()                               # its shard is an orphan that the note names
    (out / ".README.md.tmp-12345").write_text("half")                  # a killed atomic write
    (parts / ".part-00005.json.tmp-12345").write_text("{")
    (out / STATE_DIR / "staging" / "part-00000.incomplete").mkdir(parents=True)
    shutil.copy(data / "train-00000-000.arrow", out / STATE_DIR / "staging" / "part-00000.incomplete" / "x-train.arrow")
    intact = ("part-00000.json", "part-00005.json")
    mtimes = {n: (parts / n).stat().st_mtime_ns for n in intact}
    again = build(config(tiny_model), out, backend=backend, progress=False)
    assert (again.parts_built, again.parts_skipped) == (4, 2)
    assert {n: (parts / n).stat().st_mtime_ns for n in intact} == mtimes  # not redone
    assert content_hash(out) == content_hash(ref)
    assert not list(out.rglob("*.tmp-*")) and not (out / STATE_DIR / "staging").exists()
    check_consistent(out)


def test_a_second_build_of_the_same_directory_is_refused(tiny_model, backend, tmp_path):
    out = tmp_path / "out"
    (out / STATE_DIR).mkdir(parents=True)
    fd = os.open(out / STATE_DIR / "lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"4242\n")
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(BuildLockedError, match="pid 4242"):
            build(config(tiny_model), out, backend=backend, progress=False)
    finally:
        os.close(fd)
    assert build(config(tiny_model, max_samples=4), out, backend=backend, progress=False).counts.written == 4


class _DiesAfter:
    """A real backend that fails like a dead engine after ``n`` samples."""

    def __init__(self, backend, n):
        self.backend, self.n, self.seen = backend, n, 0
        self.name, self.info, self.layers = backend.name, backend.info, backend.layers

    def capture(self, samples):
        from hs_dataset.errors import BackendError

        for item in self.backend.capture(samples):
            if self.seen == self.n:
                raise BackendError("engine died")
            self.seen += 1
            yield item

    def versions(self):
        return self.backend.versions()

    def close(self):
        pass


def test_a_failed_grow_never_looks_finished_and_resumes(tiny_model, backend, tmp_path):
    from hs_dataset.errors import BackendError

    out = tmp_path / "out"
    build(config(tiny_model, max_samples=8), out, backend=backend, progress=False)
    assert (out / "hs_dataset.json").exists()
    with pytest.raises(BackendError, match="engine died"):  # raised as itself, not as DatasetGenerationError
        build(config(tiny_model, max_samples=24), out, backend=_DiesAfter(backend, 6), progress=False)
    # data/ changed (part 2 was added): the directory must not claim to be the old finished build
    assert not (out / "hs_dataset.json").exists() and not (out / "README.md").exists()
    check_consistent(out)
    assert sorted(records(out)) == ["part-00000.json", "part-00001.json", "part-00002.json"]
    s = build(config(tiny_model, max_samples=24), out, backend=backend, progress=False)
    assert (s.parts_built, s.parts_skipped) == (3, 3)
    ref = tmp_path / "ref"
    build(config(tiny_model, max_samples=24), ref, backend=backend, progress=False)
    assert content_hash(out) == content_hash(ref)
    meta = json.loads((out / "hs_dataset.json").read_text())
    assert meta["counts"]["written"] == 24 and meta["backend"]["versions"]["transformers"]
