"""The CPU's fp8 decode (hs_dataset.codec.fp8._dequantize_cpu), by the table of the 256 codes' values (few PyTorch
threads) and by the cast into the bf16 output (more), gives the bits of the definition,
``bfloat16(float32(e4m3) * scale)`` through PyTorch's cast: every code, scales from tiny to huge and non-finite,
NaN codes, any shape."""

from __future__ import annotations

import pytest
import torch

from hs_dataset.codec import fp8
from hs_dataset.codec.fp8 import fp8_dequantize, fp8_quantize


def by_cast(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (bits.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1).float()).to(torch.bfloat16)


@pytest.fixture(params=["table", "cast"], autouse=True)
def way(request, monkeypatch) -> str:
    """Each test runs both ways of the decode (chosen by the number of PyTorch threads)."""
    monkeypatch.setattr(fp8, "TABLE_MAX_THREADS", 1 << 30 if request.param == "table" else 0)
    return request.param


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, except that any NaN equals any NaN (a product with NaN keeps no payload to compare)."""
    both_nan = a.isnan() & b.isnan()
    return a.shape == b.shape and bool(((a.view(torch.int16) == b.view(torch.int16)) | both_nan).all())


def test_every_code_at_every_kind_of_scale():
    codes = torch.arange(256, dtype=torch.uint8).repeat(72, 1)  # 0x7F and 0xFF: the NaN codes
    scale = torch.cat([torch.logspace(-40, 38, 64), torch.tensor([0.0, -1.0, 1e-45, 3e38, float("inf"),
                                                                  float("-inf"), float("nan"), 1 / 448])])
    got = fp8_dequantize(codes, scale.float())
    ref = by_cast(codes, scale.float())
    assert same_bits(got, ref)
    assert bool(got[:, 0x7F].isnan().all()) and bool(got[:, 0xFF].isnan().all())
    assert not bool(got[:64, :0x7F].isnan().any())  # finite scales: only the NaN codes give NaN


@pytest.mark.parametrize("shape", [(2048, 7168), (3, 5), (1, 1), (0, 16), (7, 1000)])
def test_quantized_states_decode_to_the_casts_bits(shape, monkeypatch):
    monkeypatch.setattr(fp8, "_CPU_BLOCK", 4000)  # blocks of a few rows: a block boundary inside most shapes
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * torch.logspace(-8, 8, shape[0] or 1)[:shape[0], None]).to(torch.bfloat16)
    if x.numel() > 20:
        x[0, :5] = 0  # zeros and subnormal codes
        x[1, 3] = 1e-30
    bits, scale = fp8_quantize(x)
    assert same_bits(fp8_dequantize(bits, scale), by_cast(bits, scale))


def test_any_leading_shape_and_strided_bits():
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 256, (4, 6, 40), generator=g, dtype=torch.uint8)
    scale = torch.rand(4, 6, generator=g) * 10
    assert same_bits(fp8_dequantize(bits, scale), by_cast(bits, scale))
    strided = bits.transpose(0, 1)  # not contiguous
    assert same_bits(fp8_dequantize(strided, scale.T), by_cast(strided.contiguous(), scale.T))


def test_with_subnormals_flushed_the_decode_still_gives_the_casts_bits():
    """No float32 subnormal is made on the way (the codes with exponent 0 come from a table of normals): where the
    process reads subnormals as zero (``torch.set_flush_denormal``), it still gives what the cast gives there."""
    bits = torch.arange(256, dtype=torch.uint8).repeat(4, 1)
    scale = torch.tensor([1.0, 0.5, 3.0, 1e-3])
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        got, ref = fp8_dequantize(bits, scale), by_cast(bits, scale)
    finally:
        torch.set_flush_denormal(False)
    assert same_bits(got, ref) and bool((got[:, 1:8] != 0).all())  # the subnormal codes 1..7 are not zero
