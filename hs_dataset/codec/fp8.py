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

import functools
import threading

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
    if bits.device.type == "cpu" and bits.numel():
        h = bits.shape[-1]
        return _dequantize_cpu(bits.reshape(-1, h), scale.reshape(-1)).view(bits.shape)
    return (bits.view(torch.float8_e4m3fn).float() * scale.unsqueeze(-1).float()).to(torch.bfloat16)


_CPU_BLOCK = 1 << 22  # values decoded at a time on the CPU: an int32 and a float32 scratch block, 32 MiB a thread
_scratch = threading.local()  # each decoding thread's scratch, kept: fresh blocks would cost their page faults again


@functools.cache
def _values() -> torch.Tensor:
    """Each code's float32 value, as PyTorch's cast makes it (made at the first decode: a process that decodes no fp8
    does not load the cast's code)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _dequantize_cpu(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """:func:`fp8_dequantize` of ``[T, H]`` bits on the CPU: each code's float32 value looked up in a table of the
    256 (PyTorch's float8 -> float32 cast makes them, once), times the scale into the bf16 output: the cast's
    product, one rounding. PyTorch's cast converts one value at a time (``benchmarks/fp8_decode.py`` times both).

    Block by block (:data:`_CPU_BLOCK` values), in scratch each thread keeps: three PyTorch calls a block, each
    parallel across PyTorch's threads. Few and large on purpose: where another process keeps a core busy, each
    parallel call can wait for a thread that is not running. A first version (bits moved into float32's, ~10 calls
    a block of 512 Ki values) read the stand-in's fp8 build at 0.07 GB/s on the H200's host with the SGLang engine
    alive beside it, against 0.88 with the cast; alone there it decoded 5.4 GB/s (2.2 with mostly subnormal codes,
    which it took through float32 subnormals). On the 2-core VM beside a busy process: the cast 0.30, the table in
    blocks of 256 Ki values 0.39-0.88, this 1.02-1.06 GB/s (1.6 alone).
    """
    t, h = bits.shape
    out = torch.empty((t, h), dtype=torch.bfloat16)
    rows = max(1, min(t, _CPU_BLOCK // max(h, 1)))
    idx, vals = getattr(_scratch, "blocks", (None, None))
    if idx is None or vals is None or idx.numel() < rows * h:
        idx, vals = torch.empty(rows * h, dtype=torch.int32), torch.empty(rows * h, dtype=torch.float32)
        _scratch.blocks = (idx, vals)
    sc = scale.float()
    for a in range(0, t, rows):
        b = min(a + rows, t)
        n = (b - a) * h
        idx[:n].view(b - a, h).copy_(bits[a:b])
        torch.index_select(_values(), 0, idx[:n], out=vals[:n])
        torch.mul(vals[:n].view(b - a, h), sc[a:b, None], out=out[a:b])
    return out
