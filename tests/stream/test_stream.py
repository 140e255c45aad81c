"""Train while it builds (issue 31): trainer processes read a running build's rows from its stream, and
what they get is the committed version, row for row and bit for bit.

Each test builds the tiny demo model's rows (transformers backend, CPU) with a
:class:`~hs_dataset.stream.StreamPublisher` while trainer processes (``tests/stream/trainer.py``) read
``open_stream(OUT)``; the build runs on a thread of the test, so that the test can kill and restart a
trainer meanwhile (or, in the rerun test, as the real ``hs-dataset build --stream`` in a process that
the test kills).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from hs_dataset.read.iterate import iter_torch
from hs_dataset.read.open import open_dataset
from hs_dataset.stream import StreamPublisher, open_stream
from hs_dataset.stream.deal import epoch_order, position, rows_of_rank
from hs_dataset.write.driver import build
from tests.fixtures.builds import DEMO, config, root_env
from tests.stream.trainer import digest

ROOT = Path(__file__).resolve().parents[2]
ROW_BYTES = 14_000  # about one tiny-model row of the demo (4 states x 64 x bf16 x ~150 tokens)


class WaitForReaders(StreamPublisher):
    """A publisher whose build starts generating only once ``n`` trainers are attached (so that the test
    knows rows went through the spool, not only through the committed shards)."""

    def __init__(self, n: int, **kw):
        super().__init__(**kw)
        self.n = n

    def start(self, out, parts, done):
        super().start(out, parts, done)
        t0 = time.monotonic()
        while len(list((self.spool / "readers").glob("*.json"))) < self.n:
            assert time.monotonic() - t0 < 120, "the trainers never attached to the stream"
            time.sleep(0.05)


def trainer(address: Path | str, ckpt: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.stream.trainer", str(address), "--ckpt", str(ckpt), *args],
                            cwd=ROOT, env=root_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen) -> dict:
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-3000:]
    return json.loads(stdout.splitlines()[-1])


def in_thread(fn, *args, **kw) -> tuple[threading.Thread, list]:
    result: list = []

    def run():
        try:
            result.append(fn(*args, **kw))
        except BaseException as e:  # handed to the test
            result.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, result


def version_rows(out: Path) -> list[list[str]]:
    """[id, digest] of every row of the finished build, in the version's order."""
    return [[row["id"], digest(row)] for row in iter_torch(open_dataset(out))]


def spool_sizes(out: Path) -> list[int]:
    """The spool bytes of each row of the build: its Arrow IPC stream, as the spool holds it."""
    ds = open_dataset(out).with_format("arrow")
    sizes = []
    for i in range(len(ds)):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, ds[i].schema) as w:
            w.write_table(ds[i])
        sizes.append(sink.getvalue().size)
    return sizes


def expected(rows: list, rank: int, world: int, seed: int, epoch: int) -> list:
    order = epoch_order(len(rows), seed, epoch)
    return [rows[int(order[position(j, rank, world, seed, epoch)])]
            for j in range(rows_of_rank(len(rows), rank, world, seed, epoch))]


def test_a_trainer_gets_the_rows_of_the_finished_build_bit_for_bit(tiny_model, backend, tmp_path):
    out = tmp_path / "out"
    p = trainer(out, tmp_path / "ckpt.json", "--epochs", "2", "--seed", "7", "--write")
    pub = WaitForReaders(1)
    s = build(config(tiny_model, max_samples=24), out, backend=backend, progress=False, sink=pub)
    got = finish(p)
    rows = version_rows(out)
    assert len(rows) == s.counts.written == 24
    assert got["epochs"][0] == rows  # epoch 0: the version's rows, in its order, the same bytes
    assert got["stats"]["spool"] >= 1  # ... handed out from the build's memory as they were made
    assert got["epochs"][1] == expected(rows, 0, 1, 7, 1) != rows  # epoch 1: the version, in a seeded order
    # every row once an epoch: in epoch 0 from the spool, or (the build got there first) from the committed
    # parts or the version; epoch 1 from the version
    assert got["stats"]["spool"] + got["stats"]["committed"] + got["stats"]["version"] == 2 * 24
    assert got["stats"]["spool"] <= pub.stats.spooled == 24 and pub.stats.evicted == 0
    assert not Path(pub.spool).exists()  # the spool is gone with the build; nothing is left in /dev/shm
    # after the build: the same seed gives the same rows in the same order, read from the version
    again = open_stream(out, seed=7, rank=0, world_size=1)
    assert [[r["id"], digest(r)] for r in again] == rows and again.stats["version"] == 24
    assert [[r["id"], digest(r)] for r in again] == got["epochs"][1]
    other = open_stream(out, seed=8, rank=0, world_size=1)
    other.set_epoch(1)
    assert [[r["id"], digest(r)] for r in other] != got["epochs"][1]


def test_two_ranks_see_disjoint_rows_that_cover_the_build(tiny_model, backend, tmp_path):
    out = tmp_path / "out"
    ps = [trainer(out, tmp_path / f"ckpt{r}.json", "--rank", str(r), "--world", "2", "--dist", str(tmp_path),
                  "--epochs", "2") for r in (0, 1)]
    build(config(tiny_model, max_samples=23), out, backend=backend, progress=False, sink=WaitForReaders(2))
    got = [finish(p) for p in ps]
    rows = version_rows(out)
    assert [g["rank"] for g in got] == [0, 1] and all(g["world"] == 2 for g in got)  # from torch.distributed
    for epoch in (0, 1):
        seen = got[0]["epochs"][epoch] + got[1]["epochs"][epoch]
        assert sorted(map(tuple, seen)) == sorted(map(tuple, rows))  # every row once, bytes as committed
        assert {len(g["epochs"][epoch]) for g in got} == {11, 12}
        assert [g["epochs"][epoch] for g in got] == [expected(rows, r, 2, 0, epoch) for r in (0, 1)]
    assert sum(g["stats"]["spool"] for g in got) >= 2


def test_even_deals_every_rank_the_same_number_of_rows(tiny_model, backend, tmp_path):
    out = tmp_path / "out"
    build(config(tiny_model, max_samples=23), out, backend=backend, progress=False)
    for epoch in (0, 1):
        seen = []
        for r in range(3):
            ds = open_stream(out, rank=r, world_size=3, even=True)
            ds.set_epoch(epoch)
            seen.append([row["id"] for row in ds])
        assert [len(s) for s in seen] == [7, 7, 7]
        assert len(set(sum(seen, []))) == 21


def test_a_rank_killed_mid_epoch_and_restarted_loses_and_repeats_nothing(tiny_model, backend, tmp_path):
    out = tmp_path / "out"
    ckpt = [tmp_path / "ckpt0.json", tmp_path / "ckpt1.json"]
    args = ["--world", "2", "--epochs", "2"]  # a rank restarted alone: no torch.distributed group to join again
    ps = [trainer(out, ckpt[0], "--rank", "0", *args, "--sleep", "0.02"),
          trainer(out, ckpt[1], "--rank", "1", *args, "--sleep", "0.15")]
    # a small budget: the build goes at the trainers' pace, so the kill lands while it runs
    pub = WaitForReaders(2, budget_bytes=4 * ROW_BYTES, stall_s=120)
    t, result = in_thread(build, config(tiny_model, max_samples=32), out, backend=backend, progress=False, sink=pub)
    t0 = time.monotonic()
    while not ckpt[1].exists() or len(json.loads(ckpt[1].read_text())["epochs"][0]) < 4:
        assert time.monotonic() - t0 < 120 and ps[1].poll() is None
        time.sleep(0.02)
    ps[1].send_signal(signal.SIGKILL)
    ps[1].wait()
    seen_before = len(json.loads(ckpt[1].read_text())["epochs"][0])
    building = t.is_alive()
    ps[1] = trainer(out, ckpt[1], "--rank", "1", *args)  # the same command: goes on from its checkpoint
    got = [finish(p) for p in ps]
    t.join()
    assert not isinstance(result[0], BaseException), result[0]
    rows = version_rows(out)
    assert got[1]["restarts"] == 1 and 4 <= seen_before < 16
    assert building  # the kill was mid-epoch, with the build running
    for epoch in (0, 1):
        seen = got[0]["epochs"][epoch] + got[1]["epochs"][epoch]
        assert sorted(map(tuple, seen)) == sorted(map(tuple, rows)), f"epoch {epoch}: a row lost or seen twice"
        assert [g["epochs"][epoch] for g in got] == [expected(rows, r, 2, 0, epoch) for r in (0, 1)]
    assert pub.stats.evicted == 0  # the killed rank's rows were released at once (it is not waited for)
    assert pub.stats.peak_bytes <= max(4 * ROW_BYTES, max(spool_sizes(out)))  # the budget (or one row past it)


def test_a_slow_trainer_bounds_the_builds_memory(tiny_model, backend, tmp_path, capsys):
    budget = 160_000  # a few rows; the whole build is 7x that
    out = tmp_path / "slow"
    p = trainer(out, tmp_path / "ckpt.json", "--sleep", "0.25")
    slow = WaitForReaders(1, budget_bytes=budget, stall_s=120)
    t = time.monotonic()
    build(config(tiny_model, max_samples=24), out, backend=backend, progress=False, sink=slow)
    slow_s = time.monotonic() - t
    got = finish(p)
    sizes = spool_sizes(out)
    alone = StreamPublisher(budget_bytes=budget)  # no trainer attached: nothing is spooled, nothing waits
    t = time.monotonic()
    build(config(tiny_model, max_samples=24), tmp_path / "alone", backend=backend, progress=False, sink=alone)
    alone_s = time.monotonic() - t
    with capsys.disabled():
        print(f"\nslow trainer (0.25 s per row): spool peak {slow.stats.peak_bytes:,} B, budget {budget:,} B, all the "
              f"rows {sum(sizes):,} B; the build waited {slow.stats.waited_s:.2f} s of {slow_s:.2f} s; trainer "
              f"{got['stats']}\nno trainer: spool peak {alone.stats.peak_bytes} B, waited {alone.stats.waited_s:.3f} s, "
              f"build {alone_s:.2f} s")
    assert sum(sizes) > 5 * budget
    assert slow.stats.peak_bytes <= max(budget, max(sizes))  # at most the budget (or one row past it)
    # the build waited for the trainer (how long depends on how fast the capture runs beside it: not a timing test)
    assert slow.stats.waited_s > 0 and slow.stats.evicted == 0
    # ... and the rows reached it through memory, but for the few the spool held when the build ended (its end
    # never waits for a reader: those are read from the committed shards)
    assert got["stats"]["spool"] >= 16 and sum(got["stats"][k] for k in ("spool", "committed", "version")) == 24
    assert alone.stats.spooled == 0 and alone.stats.skipped == 24 and alone.stats.waited_s == 0


def test_rows_of_a_part_rolled_back_by_a_crash_are_not_dealt_again(tiny_model, tmp_path):
    """The build (the real command) is SIGKILLed mid-part and run again: the trainer, which took rows of
    the part being written, goes on and ends with every committed row once, bytes as committed."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hs_dataset.cli", "build", str(ROOT / "builder_scripts" / "tiny_demo.py"), "-o",
           str(out), "--no-progress", "--set", f"model={tiny_model}", "--set", f"source={DEMO}",
           "--set", "max_samples=32", "--set", "part_size=16", "--set", "max_length=256",
           "--stream", "--stream-bytes", str(3 * ROW_BYTES)]
    env = root_env()
    ckpt = tmp_path / "ckpt.json"
    p = trainer(out, ckpt, "--sleep", "0.1")
    b = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not ckpt.exists() or len(json.loads(ckpt.read_text())["epochs"][0]) < 4:
        assert time.monotonic() - t0 < 180 and b.poll() is None, b.stderr.read() if b.poll() is not None else ""
        time.sleep(0.02)
    b.send_signal(signal.SIGKILL)
    b.wait()
    first_spool = json.loads((out / ".hs_build" / "stream.json").read_text())["spool"]
    assert not list((out / ".hs_build" / "parts").glob("part-*.json"))  # part 0 was not committed
    assert p.poll() is None  # the trainer, holding rows of that part, waits for the build to be run again
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = finish(p)
    rows = version_rows(out)
    assert got["epochs"][0] == rows  # every row once, in order, with the committed bytes (transformers: exact)
    assert Counter(i for i, _ in got["epochs"][0]).most_common(1)[0][1] == 1
    last_spool = json.loads((out / ".hs_build" / "stream.json").read_text())["spool"]
    assert first_spool != last_spool and not Path(first_spool).exists() and not Path(last_spool).exists()


@pytest.mark.slow
def test_a_trainer_on_another_node_reads_the_stream_through_ray(tiny_model, backend, tmp_path):
    """The relay (a Ray actor on the builder's node) serves a trainer process of the same Ray cluster,
    as it would one on another node: the rows come through Ray's object store, the same bytes."""
    ray = pytest.importorskip("ray")
    from hs_dataset.stream.relay import start_relay

    out = tmp_path / "out"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        start_relay("test-relay", out)
        p = subprocess.Popen([sys.executable, "-m", "tests.stream.trainer", "ray:test-relay", "--ckpt",
                              str(tmp_path / "ckpt.json"), "--epochs", "2", "--write"], cwd=ROOT,
                             env=root_env(RAY_ADDRESS=ray.get_runtime_context().gcs_address),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        build(config(tiny_model, max_samples=16), out, backend=backend, progress=False, sink=WaitForReaders(1))
        got = finish(p)
    finally:
        ray.shutdown()
    rows = version_rows(out)
    assert got["epochs"][0] == rows and got["epochs"][1] == expected(rows, 0, 1, 0, 1)
    assert got["stats"]["spool"] >= 1  # the relay took rows from the spool as they were made


def test_the_collator_batches_the_stream_as_it_batches_the_version(tiny_model, backend, tmp_path):
    import torch
    from torch.utils.data import DataLoader

    from hs_dataset.read.collate import DrafterCollator

    out = tmp_path / "out"
    build(config(tiny_model, max_samples=10), out, backend=backend, progress=False)
    streamed = list(DataLoader(open_stream(out, rank=0, world_size=1), batch_size=4, collate_fn=DrafterCollator()))
    rows = list(iter_torch(open_dataset(out)))
    direct = [DrafterCollator()(rows[i:i + 4]) for i in range(0, len(rows), 4)]
    assert len(streamed) == len(direct) == 3
    for a, b in zip(streamed, direct):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_training_example_trains_while_the_build_runs(tiny_model, tmp_path):
    out = tmp_path / "demo_out"
    env = root_env()
    train = subprocess.Popen([sys.executable, str(ROOT / "examples" / "train_drafter.py"), str(out), "--steps", "40",
                              "--stream"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = subprocess.run([sys.executable, "-m", "hs_dataset.cli", "build", str(ROOT / "builder_scripts" / "tiny_demo.py"),
                        "-o", str(out), "--no-progress", "--set", f"model={tiny_model}", "--stream"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    stdout, stderr = train.communicate(timeout=600)
    assert train.returncode == 0, stderr[-3000:]
    steps = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert len(steps) == 40  # 16 batches of epoch 0 from the stream, the rest from the finished version
    loss = [s["loss"] for s in steps]
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.05, loss


def test_a_trainer_that_stops_taking_rows_is_left_behind(tiny_model, backend, tmp_path, caplog):
    from hs_dataset.stream.rows import LocalRows

    out = tmp_path / "out"
    hung = LocalRows(out, seed=0, world=1, rank=0)  # attached (this process is alive) and never takes a row
    hung.start_at(0)
    stop = threading.Event()

    def attach() -> None:
        while not stop.is_set():
            hung.refresh()  # registers with the build's spool as soon as it appears
            time.sleep(0.02)

    t = threading.Thread(target=attach)
    t.start()
    pub = WaitForReaders(1, budget_bytes=3 * ROW_BYTES, stall_s=1.0)
    try:
        s = build(config(tiny_model, max_samples=24), out, backend=backend, progress=False, sink=pub)
    finally:
        stop.set()
        t.join()
        hung.close()
    assert s.counts.written == 24
    assert pub.stats.evicted >= 1 and pub.stats.waited_s < 4  # one stall of 1 s, then it is not waited for again
    assert "took no row for 1 s while the build waited" in caplog.text


def test_a_spool_budget_beyond_the_memory_file_system_is_refused(tiny_model, backend, tmp_path):
    from hs_dataset.errors import ConfigError

    with pytest.raises(ConfigError, match="lower --stream-bytes"):
        build(config(tiny_model, max_samples=4), tmp_path / "out", backend=backend, progress=False,
              sink=StreamPublisher(budget_bytes=1 << 60))
    assert not (tmp_path / "out" / ".hs_build" / "stream.json").exists()


@pytest.mark.slow
def test_the_stream_benchmark_runs(tmp_path):
    out = tmp_path / "stream.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stream.py"), "--backend", "transformers",
                        "--samples", "8", "--tokens", "64", "--part-size", "4", "--reps", "1", "--work",
                        str(tmp_path / "work"), "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=root_env())
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["tok_s"]) == {"plain", "alone", "trainer"} and all(v > 0 for v in res["tok_s"].values())
    trainer = [run for run in res["runs"] if run["mode"] == "trainer"][0]
    assert trainer["trainer_got_every_row"] and trainer["publisher"]["spooled"] >= 1
    assert "trainer/plain" in res["ratios"] and res["trainer_wait_after_first_s"]
