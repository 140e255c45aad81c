"""A command that fails after a child process was killed ends with its own line (issue 29): what multiprocessing's
resource tracker prints when it cleans up after the killed child (``leaked semaphore objects``) comes before it.

The tracker is a process of its own that outlives ours and writes to the same stderr: without
:func:`~hs_dataset.processes.settle_resource_tracker` its warning is the output's last line (as after a killed
SGLang scheduler on the device)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, os, signal, sys, time

    def child(q):
        lock = mp.get_context("spawn").Lock()  # registered with the resource tracker, never unregistered
        q.put(1)
        time.sleep(60)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start()
        q.get()
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        if sys.argv[1] == "settle":
            from hs_dataset.processes import settle_resource_tracker
            settle_resource_tracker()
        print("hs-dataset build: error: the last line", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)
""")


@pytest.mark.parametrize("settle", [False, True])
def test_the_resource_trackers_warning_comes_before_the_last_line(tmp_path, settle):
    script = tmp_path / "killed_child.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), "settle" if settle else "plain"], capture_output=True, text=True,
                       timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and any("leaked semaphore" in line for line in lines), r.stderr
    assert (lines[-1] == "hs-dataset build: error: the last line") == settle, r.stderr
