"""The shared-memory ring between the SGLang plugin and the builder, on the CPU: producer and
consumer in separate processes, chunk order, many requests, backpressure, either side dying,
cleanup after SIGKILL. (The GPU writes into the same ring in tests/gpu/test_sglang.py.)"""

from __future__ import annotations

import multiprocessing as mp
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from hs_dataset.capture.transport import (Ring, RingWriter, make_rid, parse_rid, private_dir, remove_stale,
                                         request_spans, rid_teacher_k)
from hs_dataset.codec.fp8 import fp8_quantize
from hs_dataset.errors import RequestError, TransportError

H, N_STATES = 64, 4
CTX = mp.get_context("spawn")


def states_of(seq: int, tokens: int) -> torch.Tensor:
    """The states a test request carries: different for every request and position."""
    g = torch.Generator().manual_seed(seq)
    return torch.randn((N_STATES, tokens, H), generator=g).to(torch.bfloat16)


def produce(directory: str, token: str, jobs: list[tuple[int, int, int]], fail: dict[int, str], hold: float) -> None:
    """A producer process: write chunk (seq, start, n) of each job in the given order, then complete it."""
    w = RingWriter.open(directory, token)
    for seq, start, n in jobs:
        if seq in fail:
            w.fail(seq, fail[seq])
            continue
        info = w.slot(seq)
        full = states_of(seq, info.num_tokens)
        if info.encoding == 0:
            for j in range(N_STATES):
                w.state_view(info, j, start, n).copy_(full[j, start:start + n])
        else:
            for j in range(N_STATES):
                q, sc = fp8_quantize(full[j, start:start + n])
                w.state_view(info, j, start, n).copy_(q)
                w.scale_view(info, j, start, n).copy_(sc)
        nonfinite = [1 if (seq == 3 and j == 2 and start == 0) else 0 for j in range(N_STATES)]
        w.complete(seq, n, nonfinite)
        w.beat()
    deadline = time.monotonic() + hold
    while time.monotonic() < deadline:
        w.beat()
        time.sleep(0.05)


def start_producer(ring: Ring, jobs, fail=None, hold=0.0):
    p = CTX.Process(target=produce, args=(str(ring.path.parent), ring.token, jobs, fail or {}, hold))
    p.start()
    return p


@contextlib.contextmanager
def producing(ring: Ring, jobs, **kw):
    """A producer process writing ``jobs`` into ``ring``; joined, and the ring closed, at the end."""
    p = start_producer(ring, jobs, **kw)
    try:
        yield p
    finally:
        p.join(30)
        ring.close()


def chunks(seq: int, tokens: int, size: int) -> list[tuple[int, int, int]]:
    return [(seq, s, min(size, tokens - s)) for s in range(0, tokens, size)]


def test_requests_arrive_whole_from_another_process_in_any_chunk_order(tmp_path):
    ring = Ring.create(tmp_path, 8 << 20)
    lengths = [1, 7, 64, 100, 33, 250, 5, 128] * 5  # 40 requests in flight at once
    leases = [ring.reserve(n, N_STATES, H, "bfloat16") for n in lengths]
    assert all(le is not None for le in leases)
    jobs = []
    for le, n in zip(leases, lengths):
        jobs += chunks(le.seq, n, 16)
    # chunks of all requests interleaved, each request's chunks backwards (positions name their rows)
    jobs.sort(key=lambda j: (-j[1], j[0]))
    with producing(ring, jobs) as p:
        for le, n in zip(leases, lengths):
            ring.wait(le, timeout=60)
            got, scales = ring.views(le)
            assert scales is None and got.shape == (N_STATES, n, H)
            assert torch.equal(got.view(torch.int16), states_of(le.seq, n).view(torch.int16))
            want = (0, 0, 1, 0) if le.seq == 3 else (0, 0, 0, 0)
            assert ring.nonfinite(le) == want
        assert ring.attached_pid == p.pid


def test_fp8_regions_carry_bits_and_scales(tmp_path):
    ring = Ring.create(tmp_path, 4 << 20)
    le = ring.reserve(50, N_STATES, H, "fp8_e4m3")
    with producing(ring, chunks(le.seq, 50, 20)):
        ring.wait(le, timeout=60)
        bits, scales = ring.views(le)
        q, sc = fp8_quantize(states_of(le.seq, 50))
        assert bits.dtype == torch.uint8 and torch.equal(bits, q)
        assert torch.equal(scales, sc)


def test_backpressure_a_full_ring_refuses_until_views_are_dropped(tmp_path):
    per = N_STATES * 100 * H * 2  # 51,200 bytes: each takes 13 pages of the ring
    ring = Ring.create(tmp_path, 4 * 13 * 4096)
    leases = [ring.reserve(100, N_STATES, H, "bfloat16") for _ in range(4)]
    assert all(leases) and ring.reserve(100, N_STATES, H, "bfloat16") is None  # full
    assert ring.fits(100, N_STATES, H, "bfloat16") and not ring.fits(1000, N_STATES, H, "bfloat16")
    p = start_producer(ring, [job for le in leases for job in chunks(le.seq, 100, 100)])
    p.join(60)
    for le in leases:
        ring.wait(le, timeout=30)
    kept, _ = ring.views(leases[0])
    kept_copy = kept.clone()
    views = [ring.views(le)[0] for le in leases[1:]]
    assert ring.reserve(100, N_STATES, H, "bfloat16") is None  # every region is still referenced
    arr = views[0][1].view(torch.int16).numpy()  # a numpy array made from a view keeps its region too
    del views
    again = [ring.reserve(100, N_STATES, H, "bfloat16") for _ in range(3)]
    assert again[0] is not None and again[1] is not None and again[2] is None  # 2 freed, 1 held by `arr`
    del arr
    assert ring.reserve(100, N_STATES, H, "bfloat16") is not None
    assert torch.equal(kept, kept_copy)  # the region still referenced was never handed out again
    assert ring.in_use() == 4 * 13 * 4096 and per < 13 * 4096
    ring.close()


def test_a_failed_request_names_its_reason_and_frees_its_region(tmp_path):
    ring = Ring.create(tmp_path, 1 << 20)
    le = ring.reserve(10, N_STATES, H, "bfloat16")
    with producing(ring, [(le.seq, 0, 10)], fail={le.seq: "request x: 12 prompt positions came from the radix cache"}):
        with pytest.raises(RequestError, match="radix cache"):
            ring.wait(le, timeout=30)
        assert ring.in_use() == 0


def test_the_consumer_notices_a_dead_producer(tmp_path):
    ring = Ring.create(tmp_path, 1 << 20)
    le = ring.reserve(10, N_STATES, H, "bfloat16")
    other = ring.reserve(10, N_STATES, H, "bfloat16")
    with producing(ring, [(other.seq, 0, 10)], hold=60) as p:  # alive and beating, never writes `le`
        ring.wait(other, timeout=30)
        os.kill(p.pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(TransportError, match="stopped: no heartbeat"):
            ring.wait(le, timeout=60, stale_after=1.0)
        assert time.monotonic() - t < 5
        with pytest.raises(TransportError, match="position 0 of 10 after 0 s"):
            ring.wait(le, timeout=0.3, stale_after=100)


def _hold_ring(directory: str, ready) -> None:
    d, _fd = private_dir(directory)
    ring = Ring.create(d, 1 << 20)
    ring2 = Ring.create(directory, 1 << 20)
    ready.put((str(d), str(ring.path), str(ring2.path)))
    time.sleep(600)


def test_the_producer_notices_a_dead_consumer_and_sigkill_leaves_nothing_after_cleanup(tmp_path):
    q = CTX.Queue()
    p = CTX.Process(target=_hold_ring, args=(str(tmp_path), q))
    p.start()
    private, ring_in_private, ring_shared = (Path(x) for x in q.get(timeout=60))
    w = RingWriter.open(private, ring_in_private.name.split("-", 1)[1])
    mine = Ring.create(tmp_path, 1 << 20)  # a live consumer's ring: never removed
    try:
        assert w.owner_alive()
        assert remove_stale(tmp_path) == []  # the owner is alive
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert not w.owner_alive()
        removed = remove_stale(tmp_path)
        assert sorted(removed) == sorted([str(private), str(ring_shared)])
        assert not private.exists() and not ring_shared.exists() and mine.path.exists()
    finally:
        w.close()
        mine.close()
    assert list(tmp_path.iterdir()) == []


def test_a_ring_larger_than_the_shared_memory_is_refused_up_front(tmp_path):
    st = os.statvfs(tmp_path)
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    with pytest.raises(TransportError, match=r"needs .* GiB .* backend_options.ring_bytes"):
        Ring.create(tmp_path, too_big)
    assert list(tmp_path.iterdir()) == []


def test_request_ids_and_spans(tmp_path):
    assert parse_rid("hsds-abc123-17", "hsds-") == ("abc123", 17)
    assert parse_rid("other-1", "hsds-") is None and parse_rid("hsds-x", "hsds-") is None
    # a request that asks for the teacher's top-k says its k (every TP rank reads it from the batch)
    assert make_rid("hsds-", "abc123", 17, 64) == "hsds-abc123-17-k64" and make_rid("hsds-", "abc123", 17) == "hsds-abc123-17"
    assert parse_rid("hsds-abc123-17-k64", "hsds-") == ("abc123", 17) and rid_teacher_k("hsds-abc123-17-k64", "hsds-") == 64
    assert parse_rid("hsds-a-k9-3", "hsds-") == ("a-k9", 3) and rid_teacher_k("hsds-a-k9-3", "hsds-") == 0
    assert rid_teacher_k("hsds-abc123-17", "hsds-") == 0 and rid_teacher_k("other-1-k64", "hsds-") == 0
    ring = Ring.create(tmp_path, 1 << 20)
    plain, asks = ring.reserve(4, N_STATES, H, "bfloat16"), ring.reserve(4, N_STATES, H, "bfloat16", teacher_k=8)
    assert parse_rid(ring.rid(plain, "hsds-"), "hsds-") == (ring.token, plain.seq)
    assert parse_rid(ring.rid(asks, "hsds-"), "hsds-") == (ring.token, asks.seq)
    assert (rid_teacher_k(ring.rid(plain, "hsds-"), "hsds-"), rid_teacher_k(ring.rid(asks, "hsds-"), "hsds-")) == (0, 8)
    ring.close()
    rids = ["hsds-a-0", "other-1", "hsds-a-2", "hsds-a-3"]
    spans = request_spans(rids, [5, 3, 4, 2], [0, 0, 128, 0], "hsds-")
    # rows: a0 0..5, other 5..8 (skipped), a2 8..12 (a chunk starting at position 128), a3 12..14
    assert spans == [("hsds-a-0", 0, 0, 5), ("hsds-a-2", 8, 128, 4), ("hsds-a-3", 12, 0, 2)]


def test_views_outlive_the_ring(tmp_path):
    """Closing the ring (the backend closing) never unmaps memory a result still views."""
    ring = Ring.create(tmp_path, 1 << 20)
    le = ring.reserve(10, N_STATES, H, "bfloat16")
    p = start_producer(ring, [(le.seq, 0, 10)])
    p.join(60)
    ring.wait(le, timeout=30)
    states, _ = ring.views(le)
    ring.close()
    assert not list(tmp_path.iterdir())
    assert torch.equal(states.view(torch.int16), states_of(le.seq, 10).view(torch.int16))
