"""Statistics counted where the states are made (issue 26: the build keeps up with fast storage): the SGLang
plugin's per-token kernels (hs_dataset.codec.state_stats, run here on the CPU as the plugin runs them on the
GPU) give what the host recounts from the stored values, added up over passes and requests; through the real
ring they reach the build with each sample, whole on its last piece."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hs_dataset.codec.fp8 import fp8_quantize
from hs_dataset.codec.state_stats import FIELDS, add_stats, span_stats, token_stats
from hs_dataset.errors import BackendError
from hs_dataset.integrity.stats import row_stats
from hs_dataset.integrity.summary import REL_TOLERANCE
from hs_dataset.integrity.value_stats import ColumnStats, column_stats
from hs_dataset.records import TokenizedSample
from tests.fixtures.builds import wide_model_dir
from tests.fixtures.ring_engine import ThreadEngine


def states(T: int, H: int = 1024, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * torch.logspace(-2, 2, T)[:, None]
    x[:, :3] *= 4000  # outlier channels: values beyond 448, and fp8 codes at the limit beyond each token's largest
    x[5] = 0  # an all-zero token
    return x.to(torch.bfloat16)


def host(x: torch.Tensor, scales: torch.Tensor | None = None) -> ColumnStats:
    """What the build's host counts from the stored values (and a verify recounts from the shards)."""
    if scales is None:
        return column_stats({"h": x.view(torch.int16).numpy().view(np.uint16)}, "h")
    return column_stats({"h": x.numpy(), "h_scale": scales.numpy()}, "h")


def as_column(v: torch.Tensor) -> ColumnStats:
    return row_stats({"id": "x", "input_ids": [1], "loss_mask": [1], "h": np.zeros(1, np.uint16)}, ["h"],
                     v[None]).columns["h"]


def assert_same(got: ColumnStats, want: ColumnStats) -> None:
    """Counts equal; sums and the largest magnitude within the tolerance a verify allows."""
    assert (got.values, got.nan, got.inf, got.fp8_limit) == (want.values, want.nan, want.inf, want.fp8_limit)
    scale = math.sqrt(want.values * want.sumsq)
    assert abs(got.sum - want.sum) <= REL_TOLERANCE * scale, (got.sum, want.sum)
    assert got.sumsq == pytest.approx(want.sumsq, rel=REL_TOLERANCE)
    assert got.absmax == pytest.approx(want.absmax, rel=REL_TOLERANCE)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_the_plugins_statistics_equal_the_hosts_count_of_the_stored_values(dtype):
    x = states(600)
    stored = (x,) if dtype == "bfloat16" else fp8_quantize(x)
    per_token = token_stats(*stored)
    assert per_token.shape == (600, len(FIELDS))
    got = as_column(span_stats(per_token[None], [(0, 600)])[0, 0])
    want = host(*stored)
    assert want.fp8_limit > 600  # beyond one per token: the outliers
    assert_same(got, want)


def test_requests_of_a_pass_and_passes_of_a_request_add_up():
    """One pass holds three requests back to back beside tokens that are not ours; a request's passes add up to
    what it stores: the plugin's bookkeeping (span_stats per pass, add_stats per request)."""
    x = states(900, seed=1)
    q, s = fp8_quantize(x)
    per_token = torch.stack([token_stats(x), token_stats(q, s)])  # two states: [2, 900, 5]
    spans = [(0, 200), (250, 300), (700, 180)]  # 200..250 and 550..700 and 880.. belong to other requests
    got = span_stats(per_token, spans)
    for i, (off, n) in enumerate(spans):
        assert_same(as_column(got[0, i]), host(x[off:off + n]))
        assert_same(as_column(got[1, i]), host(q[off:off + n], s[off:off + n]))
    total = np.zeros((2, len(FIELDS)), dtype=np.float64)
    for a in range(0, 900, 128):  # a request in chunked-prefill passes of 128 tokens
        add_stats(total, span_stats(per_token[:, a:a + 128], [(0, min(128, 900 - a))])[:, 0])
    assert_same(as_column(total[0]), host(x))
    assert_same(as_column(total[1]), host(q, s))


def test_spans_back_to_back_out_of_order_and_to_the_last_token_add_up():
    """A pass whose requests fill it: spans given in any order, one ending at the pass's last token (NumPy's
    reduceat takes that end as "to the end"), an empty one; overlapping spans are refused."""
    x = states(500, seed=2)
    per_token = token_stats(x)[None]
    spans = [(300, 200), (0, 120), (120, 180), (120, 0)]
    got = span_stats(per_token, spans)
    for i, (off, n) in enumerate(spans[:3]):
        assert_same(as_column(got[0, i]), host(x[off:off + n]))
    assert not got[0, 3].any()  # the empty span counts nothing
    with pytest.raises(ValueError, match="overlap"):
        span_stats(per_token, [(0, 130), (120, 10)])


def random_states(width: int):
    pool = torch.randn((4, 700, width), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    pool[:, :, 0] *= 1000
    return lambda ids, a, b: pool[:, a:b]


def test_each_sample_reaches_the_build_with_its_statistics_whole_on_its_last_piece(tmp_path):
    """Through the real ring (the producer thread adds each chunk's statistics as the plugin does): a sample in
    a whole region and one passing a window in pieces carry the totals of everything they store."""
    model = wide_model_dir(tmp_path / "wide", hidden=256)
    states_of = random_states(256)
    # 4 states x 256 x 2 B = 2 KiB per token: a 600-token sample needs 1.2 MiB, more than half the 1.5 MiB ring
    eng = ThreadEngine(str(model), (0, 1, 2), states_of, ring_dir=tmp_path / "ring", ring_bytes=3 << 19, chunk=64)
    samples = [TokenizedSample(f"s{n}", np.arange(1, n + 1, dtype=np.int32), np.ones(n, np.uint8)) for n in (90, 600)]
    try:
        got = [(r.sample.sample_id, r.token_start, r.num_positions, r.value_stats.clone())
               for r in eng.capture(samples, row_tokens=64, max_tokens=600)]
    finally:
        eng.close()
    assert eng.windowed == [False, True]
    by_sample: dict[str, list] = {}
    for sid, start, n, counted in got:
        by_sample.setdefault(sid, []).append((start, n, counted))
    for s in samples:
        pieces = by_sample[s.sample_id]
        assert sum(n for _, n, _ in pieces) == s.num_tokens
        *earlier, (_, _, last) = pieces
        assert all(not bool(c.any()) for _, _, c in earlier)  # zeros: the whole sample's come with its last piece
        whole = states_of(None, 0, s.num_tokens)
        for j in range(4):
            assert_same(as_column(last[j]), host(whole[j]))
    assert len(by_sample["s600"]) > 1


def test_a_producer_that_did_not_count_is_refused_naming_the_version(tmp_path, monkeypatch):
    """A plugin of another hs_dataset version (no statistics in the ring): the build stops and says so, rather
    than recording zeros."""
    from hs_dataset.capture.transport import RingWriter

    complete = RingWriter.complete
    monkeypatch.setattr(RingWriter, "complete", lambda self, seq, rows, nonfinite, stats=None:
                        complete(self, seq, rows, nonfinite))
    model = wide_model_dir(tmp_path / "wide", hidden=64)
    eng = ThreadEngine(str(model), (0, 1, 2), random_states(64), ring_dir=tmp_path / "ring", ring_bytes=8 << 20)
    try:
        with pytest.raises(BackendError, match="another hs_dataset version") as e:
            list(eng.capture([TokenizedSample("s", np.arange(1, 50, dtype=np.int32), np.ones(49, np.uint8))]))
    finally:
        eng.close()
    assert "\n" not in str(e.value)
