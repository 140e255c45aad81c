"""A tiny wall-clock stack sampler for the benchmarks: where does each Python thread spend its time?

Every ``interval`` seconds it reads ``sys._current_frames()`` and counts, per thread, the innermost
frame and the innermost frame of hs_dataset's own code. Threads blocked in C code that released
the GIL (file writes, waits) are sampled at the Python line that called it; C code holding the GIL
delays the sample, so those figures are a lower bound.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from typing import Any


def _where(frame) -> tuple[str, str]:
    inner = f"{frame.f_code.co_name} {frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno}"
    ours = "-"
    f = frame
    while f is not None:
        if "/hs_dataset/" in f.f_code.co_filename:
            ours = f"{f.f_code.co_name} {f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno}"
            break
        f = f.f_back
    return inner, ours


class StackSampler:
    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def __enter__(self) -> "StackSampler":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                inner, ours = _where(frame)
                name = names.get(ident, str(ident))
                name = name.split("_")[0] if name.startswith("ThreadPoolExecutor") else name
                self.counts[name][f"{ours} | {inner}"] += 1
            self.samples += 1
            time.sleep(self.interval)

    def report(self, top: int = 8) -> dict[str, Any]:
        """{thread: [[share of samples, "hs_dataset frame | innermost frame"], ...]}"""
        out = {}
        for name, c in self.counts.items():
            total = sum(c.values())
            if total < self.samples * 0.2:  # short-lived threads
                continue
            out[name] = [[round(n / total, 3), k] for k, n in c.most_common(top)]
        return out
