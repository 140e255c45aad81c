"""The fp8 e4m3 encoding of hidden states, one implementation for the CPU and the GPU.

Each token of each state gets its own scale: ``scale = max(amax, 1e-12) * (1/448)`` (448 is the
largest finite float8 e4m3fn value, as in vLLM speculators' hidden-state connectors), and the values
are stored as ``float8_e4m3fn(x / scale)``. The SGLang plugin quantizes on the GPU (so fp8 moves half
the bytes over PCIe, through the ring and to disk), in the Triton kernel of
:mod:`hs_dataset.codec.state_scan_triton`, which makes the same bits as :func:`fp8_quantize`; the encode
stage runs this function on the CPU for backends that deliver bf16. Every step is an IEEE float32 operation
with round-to-nearest (abs, max, a multiplication by the float32 constant 1/448, a tensor division,
the fp8 cast), so both devices give the same bits; the GPU test pins it. (A division by the Python
scalar 448 would not: PyTorch's CUDA kernel turns it into a multiplication by its reciprocal, the
CPU kernel divides.)

Imports nothing but torch: the SGLang plugin loads it in the scheduler process.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "fp8_dequantize", "fp8_quantize"]

FP8_MAX = 448.0  # largest finite float8 e4m3fn value
_INV_FP8_MAX = 1.0 / FP8_MAX
_MIN_AMAX = 1e-12  # an all-zero token still gets a finite, non-zero scale


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16/float ``[..., H]`` -> (float8 e4m3fn bits as ``uint8 [..., H]``, float32 scales ``[...]``)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp(min=_MIN_AMAX) * _INV_FP8_MAX
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def fp8_dequantize(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize`: uint8 bits ``[..., H]`` and float32 scales ``[...]`` -> bf16:
    ``bfloat16(float32(e4m3) * scale)``, one rounding. On the CPU, :func:`_dequantize_cpu` (the same bits)."""
    if bits.device.type == "cpu" and bits.numel() and _subnormals_kept():
        h = bits.shape[-1]
        return _dequantize_cpu(bits.reshape(-1, h), scale.reshape(-1)).view(bits.shape)
    return (bits.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1).float()).to(torch.bfloat16)


_CPU_BLOCK = 1 << 19  # values decoded at a time on the CPU: two int32 scratch blocks of 2 MiB, reused
_TWO_POW_120 = float(2.0**120)
_SUBNORMAL = torch.tensor([2.0**-140], dtype=torch.float32)


def _subnormals_kept() -> bool:
    """Whether float32 subnormals take part in the CPU's arithmetic (not read as zero: ``torch.set_flush_denormal``,
    or a library built with fast-math, sets that for the whole process); :func:`_dequantize_cpu` needs them."""
    return bool(float((_SUBNORMAL * _TWO_POW_120).item()) != 0.0)


def _dequantize_cpu(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """:func:`fp8_dequantize` of ``[T, H]`` bits on the CPU by moving bits: 8.7x PyTorch's float8 -> float32 cast,
    which converts one value at a time, on the 2-core VM (``benchmarks/fp8_decode.py``).

    An e4m3 code's sign, 4 exponent and 3 mantissa bits, moved to float32's sign bit and the low end of its
    exponent and the top of its mantissa, make the float32 ``value * 2**-120``: normal codes (exponent
    ``E - 127`` for ``E - 7``) and subnormal ones (float32 subnormals, ``m * 2**-129`` for ``m * 2**-9``) alike.
    Times ``2**120`` is exact (unless subnormals are flushed: :func:`_subnormals_kept`, else the cast decodes);
    times the scale rounds once, as the cast's product does. The two NaN codes
    (``0x7F``, ``0xFF``) would read as +-480: they are set to NaN afterwards. Block by block, in scratch that
    stays in the cache (fresh [T, H] float32 temporaries cost more in page faults than the arithmetic).
    """
    t, h = bits.shape
    out = torch.empty((t, h), dtype=torch.bfloat16)
    rows = max(1, min(t, _CPU_BLOCK // max(h, 1)))
    u = torch.empty((rows, h), dtype=torch.int32)
    m = torch.empty_like(u)
    sc = scale.float()
    for a in range(0, t, rows):
        b = min(a + rows, t)
        uu, mm = u[:b - a], m[:b - a]
        uu.copy_(bits[a:b])
        torch.bitwise_and(uu, 0x7F, out=mm)
        nan = mm == 0x7F if int(mm.max()) == 0x7F else None  # NaN codes (NaN written, non-finite checks off)
        mm.bitwise_left_shift_(20)  # exponent and mantissa: float32's bits 20..26
        uu.bitwise_and_(0x80).bitwise_left_shift_(24).bitwise_or_(mm)  # the sign: bit 31
        f = uu.view(torch.float32)
        f.mul_(_TWO_POW_120).mul_(sc[a:b, None])
        if nan is not None:
            f[nan] = float("nan")
        out[a:b].copy_(f)
    return out
