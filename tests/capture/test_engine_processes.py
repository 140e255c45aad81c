"""Closing an in-process SGLang engine ends the engine's processes and nothing else of this process.

``sglang.Engine.shutdown`` SIGKILLs every child of the process that started it: on the device, a trainer
that the same script started to read the build's stream died with the build (exit -9). The backend now
kills only what the engine's start began (:mod:`hs_dataset.capture.sglang.engine`); here that is checked
with real processes standing in for the engine: a child that starts a grandchild, as SGLang's scheduler
starts its helpers.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

psutil = pytest.importorskip("psutil")

from hs_dataset.capture.sglang.engine import _child_pids, _kill_trees, _started_since  # noqa: E402

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
PARENT = [sys.executable, "-c", "import subprocess, sys, time; "
          "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"]


def test_only_what_the_engine_start_began_is_killed():
    trainer_before = subprocess.Popen(SLEEP)  # started by the same script before the engine
    before = _child_pids()
    engine = subprocess.Popen(PARENT)  # "the engine's start": a process with a child of its own
    deadline = time.time() + 30
    while not psutil.Process(engine.pid).children() and time.time() < deadline:
        time.sleep(0.05)
    (helper,) = psutil.Process(engine.pid).children()
    started = _started_since(before)
    trainer_after = subprocess.Popen(SLEEP)  # started while the build runs
    try:
        assert [p.pid for p in started] == [engine.pid]
        t = time.time()
        _kill_trees(started, wait_s=30)
        assert not psutil.pid_exists(engine.pid)  # killed and reaped
        assert not helper.is_running() or helper.status() == psutil.STATUS_ZOMBIE
        assert time.time() - t < 30
        assert trainer_before.poll() is None and trainer_after.poll() is None  # the others live on
    finally:
        for p in (trainer_before, trainer_after, engine):
            p.kill()
            p.wait()
