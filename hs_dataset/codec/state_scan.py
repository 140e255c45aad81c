"""One read of a state the engine made: its NaN/Inf tokens, its fp8 codes, and the statistics of what is stored.

The SGLang plugin needs three things from each state of each EXTEND pass before it copies the state out:
which tokens hold a NaN or Inf (``on_nonfinite``), the fp8 codes and scales when a request stores fp8
(:func:`hs_dataset.codec.fp8.fp8_quantize`), and the statistics of the stored values
(:func:`hs_dataset.codec.state_stats.token_stats`). Written as PyTorch operations these read the state
about a dozen times and allocate temporaries of its size (fp8: four float32 copies), on the stream that runs
beside the engine's. :func:`scan_state` does all three in one read: on a CUDA tensor, one Triton kernel per
state (:mod:`hs_dataset.codec.state_scan_triton`), a program per token; elsewhere (the CPU, a hidden size
the kernel does not take) the PyTorch functions above, which are also the reference the GPU test holds the
kernel to: the same NaN/Inf tokens, the same fp8 bits and scales, the statistics within
:data:`hs_dataset.integrity.summary.REL_TOLERANCE`.

Imports nothing but torch (Triton on first use on a GPU): the SGLang plugin loads it in the scheduler process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hs_dataset.codec.fp8 import fp8_quantize
from hs_dataset.codec.state_stats import token_stats

__all__ = ["KERNEL_MAX_HIDDEN", "StateScan", "scan_state", "warm_up"]

# The kernel holds a token's values in registers (a block of 8,192: Kimi-K2.5 / DeepSeek-V3's 7,168, Llama-70B's
# 8,192); wider states take the PyTorch path (its 16,384-wide form failed its GPU test on the H200, cause not read)
KERNEL_MAX_HIDDEN = 8192
_kernel_error: str | None = None  # why the kernel is not used in this process (warm_up could not compile it)


@dataclass
class StateScan:
    """What :func:`scan_state` read from one state ``[T, H]``."""

    nonfinite: torch.Tensor  # bool [T]: the token holds a NaN or an Inf
    bf16_stats: torch.Tensor  # float64 [T, 5]: token_stats of the state as bf16
    fp8: tuple[torch.Tensor, torch.Tensor] | None  # fp8_quantize's (uint8 codes [T, H], float32 scales [T])
    fp8_stats: torch.Tensor | None  # float64 [T, 5]: token_stats of the fp8 values (codes x scales)

    def stats(self, fp8: bool) -> torch.Tensor:
        """The statistics of the values stored in one encoding (fp8: only when scanned with ``fp8=True``)."""
        if not fp8:
            return self.bf16_stats
        if self.fp8_stats is None:
            raise ValueError("this state was scanned without fp8: call scan_state(x, fp8=True)")
        return self.fp8_stats


def scan_state(x: torch.Tensor, fp8: bool = False, kernel: bool | None = None) -> StateScan:
    """Read one state ``[T, H]`` (bf16, or another float type, counted as bf16) once.

    Args:
        x: the state; its last dimension contiguous.
        fp8: also quantize it to fp8 and count the fp8 values' statistics.
        kernel: use the Triton kernel (default: on a CUDA tensor of ``H <= KERNEL_MAX_HIDDEN``, unless
            :func:`warm_up` could not compile it in this process).
    """
    if kernel is None:
        kernel = _kernel_error is None and x.is_cuda and x.shape[-1] <= KERNEL_MAX_HIDDEN and x.stride(-1) == 1
    if kernel:
        from hs_dataset.codec.state_scan_triton import scan_rows  # optional: Triton, on a GPU only

        return StateScan(*scan_rows(x, fp8))
    nonfinite = ~torch.isfinite(x).all(dim=-1)
    q = fp8_quantize(x) if fp8 else None
    return StateScan(nonfinite=nonfinite, bf16_stats=token_stats(x.to(torch.bfloat16)), fp8=q,
                     fp8_stats=token_stats(*q) if q is not None else None)


def warm_up(hidden: int, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Compile the kernels for states of width ``hidden`` on the current GPU (Triton compiles on first use, a
    second or more each): the SGLang plugin calls it when the model is loaded, so no build waits for it.

    Returns:
        None, or why the kernel cannot be used here (Triton missing, a compiler failure: one version of
        ``ptxas`` crashed on a form of it): :func:`scan_state` then takes the PyTorch path in this process.
    """
    global _kernel_error
    x = torch.zeros((2, hidden), dtype=dtype, device="cuda")
    try:
        for fp8 in (False, True):
            scan_state(x, fp8=fp8)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - any failure of the optional kernel leaves the PyTorch path
        _kernel_error = f"{type(e).__name__}: {str(e)[:300]}"
    return _kernel_error
