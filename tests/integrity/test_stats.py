"""The statistics kernels count what is stored (issue 30): bf16 bits and fp8 codes times their scales, every
value including subnormal codes, NaN/Inf counted and left out, the same sums on one thread or four."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hs_dataset.codec.fp8 import fp8_quantize
from hs_dataset.integrity.stats import StatsCollector
from hs_dataset.integrity import value_stats
from hs_dataset.integrity.value_stats import column_stats


def reference(values: torch.Tensor) -> dict[str, float]:
    """mean, std, absmax of the finite values, and the NaN and Inf counts, in float64."""
    x = values.double().reshape(-1)
    ok = torch.isfinite(x)
    f = x[ok]
    return {"mean": float(f.mean()), "std": float(f.std(unbiased=False)), "absmax": float(f.abs().max()),
            "nan": int(torch.isnan(x).sum()), "inf": int(torch.isinf(x).sum())}


def states(T: int = 300, H: int = 7168, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * 2
    x[:, :3] *= 4000  # outlier channels, as in real models: most other values become subnormal fp8 codes
    return x.to(torch.bfloat16)


def check(got, want: dict[str, float]) -> None:
    assert got.nan == want["nan"] and got.inf == want["inf"]
    assert got.mean == pytest.approx(want["mean"], rel=1e-5, abs=1e-6)
    assert got.std == pytest.approx(want["std"], rel=1e-5)
    assert got.absmax == pytest.approx(want["absmax"], rel=1e-6)


def test_bf16_statistics_are_those_of_the_stored_values_nonfinite_counted_apart():
    x = states()
    x[5, 10:14] = float("nan")
    x[6, 7], x[7, 8] = float("inf"), float("-inf")
    got = column_stats({"c": x.view(torch.int16).numpy().view(np.uint16)}, "c")
    assert got.values == x.numel()
    check(got, reference(x))
    finite = x.float()[torch.isfinite(x.float())]
    assert got.fp8_limit == int((finite.abs() >= 448).sum()) > 0  # the outliers an unscaled cast saturates


@pytest.mark.parametrize("sign", [1.0, -1.0, 0.0])
def test_bf16_largest_magnitude_and_sum_with_one_sign_or_none(sign):
    x = (states(T=20, H=64).float().abs() * sign).to(torch.bfloat16)  # all positive, all negative, all zero
    if sign == 0.0:
        x = -x  # -0.0: bits 0x8000
    got = column_stats({"c": x.view(torch.int16).numpy().view(np.uint16)}, "c")
    assert got.absmax == float(x.float().abs().max())
    assert got.sum == pytest.approx(float(x.double().sum()), rel=1e-6)


def test_fp8_statistics_are_those_of_code_times_scale_subnormal_codes_included():
    q, scale = fp8_quantize(states())
    subnormal = ((q & 0x78) == 0) & ((q & 0x7F) != 0)
    assert subnormal.float().mean() > 0.05  # the decode must be exact for them too
    stored = q.view(torch.float8_e4m3fn).double() * scale.double()[:, None]
    got = column_stats({"c": q.numpy(), "c_scale": scale.numpy()}, "c")
    check(got, reference(stored))
    assert got.fp8_limit == int(((q & 0x7F) == 0x7E).sum()) >= q.shape[0]  # each token's largest value, at least

    q[3, :5] = 0x7F  # NaN codes
    q[4, :2] = 0xFF
    scale[8] = float("nan")  # a token whose scale is not finite: all its values count
    scale[9] = float("inf")
    got = column_stats({"c": q.numpy(), "c_scale": scale.numpy()}, "c")
    assert got.nan == 7 + q.shape[1] and got.inf == q.shape[1]
    keep = torch.ones(q.shape[0], dtype=torch.bool)
    keep[[8, 9]] = False
    stored = q.view(torch.float8_e4m3fn).double() * torch.where(keep, scale.double(), 0.0)[:, None]
    stored[~keep] = float("nan")
    check(got, {**reference(stored), "nan": 7 + q.shape[1], "inf": q.shape[1]})


def _stats_of(dtype: str, x: torch.Tensor):
    if dtype == "bfloat16":
        return column_stats({"c": x.view(torch.int16).numpy().view(np.uint16)}, "c")
    q, scale = fp8_quantize(x)
    return column_stats({"c": q.numpy(), "c_scale": scale.numpy()}, "c")


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_statistics_do_not_depend_on_torchs_threads_and_barely_on_the_step(dtype, monkeypatch):
    x = states(T=700, H=7168)
    x[5, 10:14] = float("nan")  # the rare path too
    threads = torch.get_num_threads()
    try:
        got = []
        for n in (1, 2, 4):  # torch splits a reduction by its thread count, not by the cores
            torch.set_num_threads(n)
            got.append(_stats_of(dtype, x).to_dict())
    finally:
        torch.set_num_threads(threads)
    assert got[0] == got[1] == got[2]  # bit for bit
    monkeypatch.setattr(value_stats, "STEP_VALUES", 1 << 16)  # 9 tokens a step: 78 steps
    small = _stats_of(dtype, x)
    for k in ("values", "nan", "inf", "fp8_limit", "absmax"):
        assert getattr(small, k) == got[0][k], k
    assert small.sum == pytest.approx(got[0]["sum"], rel=1e-9, abs=1e-6)
    assert small.sumsq == pytest.approx(got[0]["sumsq"], rel=1e-9)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8_e4m3"])
def test_a_part_sums_the_same_on_one_thread_or_four(dtype):
    rows = []
    for i in range(12):
        x = states(T=40 + 17 * i, H=512, seed=i)
        row = {"id": f"s:{i}", "input_ids": np.arange(x.shape[0], dtype=np.int32) + i,
               "loss_mask": np.ones(x.shape[0], np.uint8)}
        if dtype == "bfloat16":
            row["hidden_final"] = x.view(torch.int16).numpy().view(np.uint16)
        else:
            q, s = fp8_quantize(x)
            row["hidden_final"], row["hidden_final_scale"] = q.numpy(), s.numpy()
        rows.append(row)
    results = []
    for workers in (0, 1, 4):
        c = StatsCollector(["hidden_final"], 512, 256, workers=workers)
        for r in rows:
            c.add(r)
        results.append(c.result().to_dict())
    assert results[0] == results[1] == results[2]
    assert results[0]["rows"] == 12 and len(results[0]["ids_xxh3_64"]) == 12 * 16
