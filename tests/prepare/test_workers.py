"""The tokenize stage in worker processes: the serial path's samples and rejects, in its order, with the
source read only a few chunks ahead; a dead worker or another tokenizer is one clear error; no worker
outlives the process that started it."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from hs_dataset.config import HiddenStatesConfig
from hs_dataset.errors import ConfigError, TokenizeWorkerError
from hs_dataset.prepare.rows import TokenizeRules
from hs_dataset.prepare.samples import tokenized_samples
from hs_dataset.prepare.source_spec import resolve_source
from hs_dataset.prepare.sources import iter_source
from hs_dataset.prepare.tokenizer import load_tokenizer
from hs_dataset.prepare.workers import (AUTO_MAX_WORKERS, AUTO_MIN_ROWS, CHUNK_ROWS, CHUNKS_PER_WORKER,
                                        TokenizeWorkers, tokenize_processes, tokenizer_identity)
from hs_dataset.records import Reject, SourceRow
from tests.fixtures.builds import DEMO, ROOT, THINKING_ROWS


@pytest.fixture(scope="module")
def kimi_workers(kimi_dir: Path, kimi: Any) -> Iterator[TokenizeWorkers]:
    with TokenizeWorkers(2, kimi_dir, trust_remote_code=True, identity=tokenizer_identity(kimi)) as w:
        yield w


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo conversations, the Kimi thinking rows (an image row: a source reject), a line that is not
    JSON, a row of another schema, raw token rows (one out of the vocabulary: a tokenize reject)."""
    lines = DEMO.read_text(encoding="utf-8").splitlines()
    extra = [json.dumps(r, ensure_ascii=False) for r in THINKING_ROWS]
    extra += ["{not json", json.dumps({"text": "another schema"}),
              json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}),
              json.dumps({"input_ids": [1, 2, 10 ** 7], "loss_mask": [0, 1, 1]})]
    rows = lines[:30] + extra + lines[30:]
    path = tmp_path_factory.mktemp("mixed") / "mixed.jsonl"
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def events(config: HiddenStatesConfig, tokenizer: Any, workers: TokenizeWorkers | None,
           ranges: list[tuple[int, int | None]]) -> list[tuple]:
    """Every sample and reject of the stage, in the order the consumer sees them."""
    out: list[tuple] = []

    def reject(index: int, r: Reject) -> None:
        out.append(("reject", index, r.to_dict()))

    for index, s in tokenized_samples(resolve_source(config.source), config, tokenizer, len(tokenizer), ranges, reject, workers=workers):
        out.append(("sample", index, s.sample_id, s.input_ids.tolist(), s.loss_mask.tolist(), s.truncated))
    return out


@pytest.mark.parametrize("which", ["kimi (tiktoken, slow)", "chatml (fast)"])
def test_workers_give_the_serial_samples_and_rejects_in_its_order(which, kimi_dir, kimi, kimi_workers, tiny_model,
                                                                  mixed):
    path, remote = (kimi_dir, True) if which.startswith("kimi") else (Path(tiny_model), False)
    tok = kimi if remote else load_tokenizer(path)
    config = HiddenStatesConfig(model=str(path), source=str(mixed), layers=(0,), max_length=160, truncation="reject",
                                trust_remote_code=remote)
    ranges: list[tuple[int, int | None]] = [(0, 7), (7, 50), (58, None)]  # a gap, and a range to the end
    serial = events(config, tok, None, ranges)
    if remote:
        parallel = events(config, tok, kimi_workers, ranges)
    else:
        with TokenizeWorkers(2, path, trust_remote_code=False, identity=tokenizer_identity(tok)) as w:
            parallel = events(config, tok, w, ranges)
    assert parallel == serial
    stages = {e[2]["stage"] for e in serial if e[0] == "reject"}
    assert stages == {"source", "tokenize"}, stages  # not JSON, another schema, the image; too long, out of vocab
    assert len(serial) > 2 * CHUNKS_PER_WORKER * CHUNK_ROWS  # more rows than the queue holds
    assert sum(e[0] == "sample" for e in serial) >= 20
    assert [e[1] for e in serial] == [i for i in range(len(mixed.read_text().splitlines())) if not 50 <= i < 58]


def test_the_source_is_read_at_most_a_few_chunks_ahead(kimi_workers, kimi, mixed):
    read = 0

    def rows() -> Iterator[SourceRow]:
        nonlocal read
        for row in iter_source(mixed):
            read += 1
            yield row

    rules = TokenizeRules(max_length=160, mask="all", truncation="truncate", vocab_size=len(kimi))
    ahead = []
    results = kimi_workers.prepare(rows(), rules)
    for done, _ in enumerate(results, 1):
        ahead.append(read - done)
        time.sleep(0.002)  # a consumer slower than the workers
    assert done == len(mixed.read_text().splitlines())
    assert max(ahead) <= (kimi_workers.processes * CHUNKS_PER_WORKER + 1) * CHUNK_ROWS, max(ahead)
    # a consumer that stops early drops what is queued; the workers serve the next call as before
    first = kimi_workers.prepare(iter_source(mixed), rules)
    head = [next(first) for _ in range(3)]
    first.close()
    again = list(kimi_workers.prepare(iter_source(mixed, stop=3), rules))
    assert [(i, type(r)) for i, r in again] == [(i, type(r)) for i, r in head]


def test_a_dead_worker_stops_with_one_line_naming_the_way_out(kimi_dir, kimi, mixed):
    before = set(multiprocessing.active_children())
    with TokenizeWorkers(1, kimi_dir, trust_remote_code=True, identity=tokenizer_identity(kimi)) as w:
        rules = TokenizeRules(max_length=160, mask="all", truncation="truncate", vocab_size=len(kimi))
        assert len(list(w.prepare(iter_source(mixed, stop=4), rules))) == 4
        (mine,) = set(multiprocessing.active_children()) - before
        os.kill(mine.pid, signal.SIGKILL)
        mine.join(30)
        with pytest.raises(TokenizeWorkerError, match="a tokenize worker process died.*tokenize_workers=0"):
            list(w.prepare(iter_source(mixed), rules))


def test_a_worker_that_loads_another_tokenizer_or_none_is_refused(kimi_dir, kimi, tmp_path):
    rules = TokenizeRules(max_length=160, mask="all", truncation="truncate", vocab_size=len(kimi))
    with TokenizeWorkers(1, kimi_dir, trust_remote_code=True, identity=("Other", 7, "0" * 64)) as w:
        with pytest.raises(ConfigError, match="loaded another tokenizer"):
            list(w.prepare(iter([]), rules))
    with TokenizeWorkers(1, kimi_dir, trust_remote_code=False, identity=tokenizer_identity(kimi)) as w:
        with pytest.raises(ConfigError, match="cannot load the tokenizer.*trust_remote_code"):
            list(w.prepare(iter([]), rules))


def test_workers_die_with_the_process_that_started_them(kimi_dir, tmp_path):
    script = textwrap.dedent(f"""
        import multiprocessing, os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from hs_dataset.prepare.tokenizer import load_tokenizer
        from hs_dataset.prepare.workers import TokenizeWorkers, tokenizer_identity
        if __name__ == "__main__":
            tok = load_tokenizer({str(kimi_dir)!r}, trust_remote_code=True)
            w = TokenizeWorkers(2, {str(kimi_dir)!r}, trust_remote_code=True, identity=tokenizer_identity(tok))
            w._check()
            print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    (tmp_path / "killed.py").write_text(script)
    r = subprocess.run([sys.executable, str(tmp_path / "killed.py")], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    pids = [int(p) for p in r.stdout.split()]
    assert len(pids) == 2
    deadline = time.time() + 30
    while any(_alive(p) for p in pids):
        assert time.time() < deadline, [p for p in pids if _alive(p)]
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"  # a zombie has exited (its new parent reaps it)


def test_how_many_workers():
    assert tokenize_processes(0, 10 ** 6) == 0 and tokenize_processes(3, 5) == 3
    assert tokenize_processes(None, AUTO_MIN_ROWS - 1) == 0  # a small build: starting workers costs more
    cores = len(os.sched_getaffinity(0))
    assert tokenize_processes(None, AUTO_MIN_ROWS) == (min(cores, AUTO_MAX_WORKERS) if cores >= 2 else 0)
    with pytest.raises(ConfigError, match="tokenize_workers=-1: must be >= 0"):
        HiddenStatesConfig(model="m", source="s", tokenize_workers=-1)
