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
    ``bfloat16(float32(e4m3) * scale)``, one rounding (on the CPU: :func:`_dequantize_cpu`, the same bits)."""
    if bits.device.type == "cpu" and bits.numel():
        h = bits.shape[-1]
        return _dequantize_cpu(bits.reshape(-1, h), scale.reshape(-1)).view(bits.shape)
    out = torch.empty(bits.shape, dtype=torch.bfloat16, device=bits.device)
    _by_cast(bits, scale.float(), out)
    return out


# With at most this many PyTorch threads a CPU decode looks the codes up in a table (_by_table), faster on few cores;
# with more, it casts (_by_cast): each parallel PyTorch call waits for all of its threads, and beside a process that
# keeps a core busy (an engine's scheduler, a trainer) the table's many calls a state wait more often than the cast's
# two (benchmarks/fp8_decode.py, its results in benchmarks/results/*fp8-decode*). A DataLoader worker decodes with
# one thread.
TABLE_MAX_THREADS = 4
_CPU_BLOCK = 1 << 22  # values the table decodes at a time: an int32 and a float32 scratch block, 32 MiB a thread
_scratch = threading.local()  # each decoding thread's scratch, kept: fresh blocks would cost their page faults again


@functools.cache
def _values() -> torch.Tensor:
    """Each code's float32 value, as PyTorch's cast makes it (made at the first decode: a process that decodes no fp8
    does not load the cast's code)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _dequantize_cpu(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """:func:`fp8_dequantize` of ``[T, H]`` bits on the CPU, by a table (:func:`_by_table`) with at most
    :data:`TABLE_MAX_THREADS` PyTorch threads, else by the cast (:func:`_by_cast`): the same bits."""
    out = torch.empty(bits.shape, dtype=torch.bfloat16)
    (_by_table if torch.get_num_threads() <= TABLE_MAX_THREADS else _by_cast)(bits, scale.float(), out)
    return out


def _by_cast(bits: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """PyTorch's float8 -> float32 cast, times the float32 scale into the bf16 ``out`` (``bits [..., H]``, ``scale
    [...]``; no float32 product made): two calls, on any device."""
    torch.mul(bits.view(torch.float8_e4m3fn).float(), scale.unsqueeze(-1), out=out)


def _by_table(bits: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """Each code's float32 value looked up in a table of the 256 (PyTorch's cast makes them, once), times the scale
    into the bf16 ``out``: the cast's product, one rounding (PyTorch's cast converts one value at a time). Block by
    block (:data:`_CPU_BLOCK` values), in scratch each thread keeps, three PyTorch calls a block. No float32
    subnormal is made on the way: where subnormals are flushed, it gives what the cast gives there."""
    t, h = bits.shape
    rows = max(1, min(t, _CPU_BLOCK // max(h, 1)))
    idx, vals = getattr(_scratch, "blocks", (None, None))
    if idx is None or vals is None or idx.numel() < rows * h:
        idx, vals = torch.empty(rows * h, dtype=torch.int32), torch.empty(rows * h, dtype=torch.float32)
        _scratch.blocks = (idx, vals)
    for a in range(0, t, rows):
        b = min(a + rows, t)
        n = (b - a) * h
        idx[:n].view(b - a, h).copy_(bits[a:b])
        torch.index_select(_values(), 0, idx[:n], out=vals[:n])
        torch.mul(vals[:n].view(b - a, h), scale[a:b, None], out=out[a:b])
