"""The SGLang plugin's one read of each state on the GPU (hs_dataset.codec.state_scan, a Triton kernel) gives
what the PyTorch path gives on the CPU: the same NaN/Inf tokens, the same fp8 bits and scales, and statistics
that a verify accepts (issue 26: the builder keeps up with fast storage)."""

from __future__ import annotations

import pytest
import torch

from hs_dataset.codec.state_scan import KERNEL_MAX_HIDDEN, scan_state
from hs_dataset.codec.state_stats import span_stats
from tests.codec.test_state_stats import as_column, assert_same
from tests.gpu.models import GPU_MARKS

pytestmark = GPU_MARKS


def _states(T: int, H: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * torch.logspace(-4, 3, T)[:, None]
    x[:, :3] *= 4000  # values beyond 448 and fp8 codes at the limit
    x[5] = 0  # an all-zero token: the minimum scale
    x[7, H // 2] = float("nan")
    x[9, 1] = float("inf")
    x[11, 0] = -float("inf")
    return x.to(dtype)


def _total(per_token: torch.Tensor) -> torch.Tensor:
    """A request's statistics from its tokens', as the plugin adds them up."""
    return torch.from_numpy(span_stats(per_token[None].cpu(), [(0, per_token.shape[0])])[0, 0])


@pytest.mark.parametrize("H,dtype,packed", [(7168, torch.bfloat16, True), (7168, torch.bfloat16, False),
                                            (4096, torch.float32, False), (1000, torch.bfloat16, False),
                                            (8192, torch.bfloat16, False)])
def test_the_kernel_reads_a_state_as_the_pytorch_path_does(H, dtype, packed):
    T = 700
    x = _states(T, H, dtype, seed=H)
    if packed:  # an aux state as SGLang packs them: a column slice of [T, 3 * H], rows strided
        wide = torch.cat([_states(T, H, dtype, seed=1), x, _states(T, H, dtype, seed=2)], dim=1)
        cpu_x, gpu_x = wide[:, H:2 * H], wide.cuda()[:, H:2 * H]
    else:
        cpu_x, gpu_x = x, x.cuda()
    want = scan_state(cpu_x, fp8=True)
    got = scan_state(gpu_x, fp8=True)
    assert want.fp8 is not None and got.fp8 is not None and want.fp8_stats is not None and got.fp8_stats is not None
    assert torch.equal(got.nonfinite.cpu(), want.nonfinite)
    assert want.nonfinite.tolist().count(True) == 3
    ok = ~want.nonfinite  # a token holding NaN/Inf is never stored (on_nonfinite): its codes are not compared
    assert torch.equal(got.fp8[0].cpu()[ok], want.fp8[0][ok])
    assert torch.equal(got.fp8[1].cpu()[ok], want.fp8[1][ok])
    for g_, w_ in ((got.bf16_stats, want.bf16_stats), (got.fp8_stats, want.fp8_stats)):
        g_, w_ = g_.cpu()[ok], w_[ok]
        assert torch.equal(g_[:, [0, 4]], w_[:, [0, 4]])  # values and the count at the fp8 limit, exact
        assert_same(as_column(_total(g_)), as_column(_total(w_)))
    assert int(want.bf16_stats[:, 4].sum()) > 0 and int(want.fp8_stats[:, 4].sum()) > 0  # the limit was exercised


def test_a_state_wider_than_the_kernel_is_read_as_on_the_cpu():
    x = _states(16, KERNEL_MAX_HIDDEN + 1024, torch.bfloat16, seed=4)
    got, want = scan_state(x.cuda(), fp8=True), scan_state(x, fp8=True)
    ok = ~want.nonfinite
    assert got.fp8 is not None and want.fp8 is not None and torch.equal(got.nonfinite.cpu(), want.nonfinite)
    assert torch.equal(got.fp8[0].cpu()[ok], want.fp8[0][ok]) and torch.equal(got.fp8[1].cpu()[ok], want.fp8[1][ok])


def test_the_kernel_takes_an_empty_pass_and_bf16_only():
    x = torch.zeros((0, 7168), dtype=torch.bfloat16, device="cuda")
    s = scan_state(x, fp8=True)
    assert s.nonfinite.shape == (0,) and s.bf16_stats.shape == (0, 5) and s.fp8 is not None and s.fp8[0].shape == (0, 7168)
    y = _states(64, 2048, torch.bfloat16, seed=3)
    s = scan_state(y.cuda())
    assert s.fp8 is None and s.fp8_stats is None
    ok = ~s.nonfinite.cpu()
    assert_same(as_column(_total(s.bf16_stats.cpu()[ok])), as_column(_total(scan_state(y).bf16_stats[ok])))
