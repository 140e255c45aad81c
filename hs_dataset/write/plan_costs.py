"""What a long-context build needs beyond disk: rows, the ring and ``/dev/shm``, and prefill time by length.

Prefill slows with context (attention grows with the positions before each token), so a build of
128k-token samples takes longer per token than one of 2k-token samples. :data:`LONG_CONTEXT_RATES`
holds plain-prefill rates measured on one H200 at longer contexts (README "Long context"), and
:func:`prefill_seconds` prices each sample at the rate measured for the nearest longer context.
:func:`memory_lines` says what the SGLang path needs in shared memory for the longest sample.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from hs_dataset.capture.transport.format import DEFAULT_RING_BYTES
from hs_dataset.codec.encode import bytes_per_token
from hs_dataset.codec.limits import max_row_tokens
from hs_dataset.write.plan import BuildPlan

__all__ = ["LONG_CONTEXT_RATES", "ContextRate", "memory_lines", "prefill_seconds"]

DEFAULT_CHUNK = 8192  # SGLang's chunked prefill on an H200 when not set (what the ring window is sized for)


@dataclass(frozen=True)
class ContextRate:
    """Plain prefill of one sample of ``context`` tokens, measured on one GPU."""

    gpu: str
    hidden_size: int
    num_layers: int
    context: int
    tokens_per_second: float


# The device runs of benchmarks/long_context.py (README "Long context"), one sample each through SGLang 0.5.17
# (Triton attention, chunked prefill 16,384) on the Kimi-width stand-in with Kimi-K2's YaRN; 2,048 tokens is
# plan.MEASURED_RATES. 32k: 5,992 (2026-12-01) and 6,044 tok/s (2026-12-03); 131k: 1,137 tok/s (2026-12-03).
LONG_CONTEXT_RATES: tuple[ContextRate, ...] = (
    ContextRate("H200", 7168, 6, 32768, 5992.0),
    ContextRate("H200", 7168, 6, 131072, 1137.0),
)


def prefill_seconds(plan: BuildPlan, rate_2k: float) -> tuple[float, list[str]]:
    """Seconds of prefill for the plan's samples: each at the measured rate of the nearest longer context
    (``rate_2k`` up to 2,048 tokens), scaled by depth as :func:`hs_dataset.write.plan.estimate_rate` does."""
    info = plan.info
    rates = sorted((r for r in LONG_CONTEXT_RATES if r.hidden_size == info.hidden_size), key=lambda r: r.context)
    table = [(2048, rate_2k)] + [(r.context, r.tokens_per_second * r.num_layers / info.num_layers) for r in rates]
    total, used = 0.0, set()
    for n in plan.lengths:
        ctx, rate = next(((c, r) for c, r in table if c >= n), table[-1])
        total += n / rate
        used.add((ctx, rate))
    return total, [f"{r:,.0f} tok/s up to {c:,} tokens" for c, r in sorted(used)]


def memory_lines(plan: BuildPlan) -> list[str]:
    """The rows, ring and ``/dev/shm`` the longest sample needs (empty when every sample is short)."""
    cfg = plan.config
    if not plan.lengths:
        return []
    longest = max(plan.lengths)
    per_token = bytes_per_token(plan.n_states, plan.info.hidden_size, cfg.storage_dtype)
    row_tokens = min(cfg.row_tokens, max_row_tokens(plan.info.hidden_size))
    lines = []
    if cfg.max_length > row_tokens:
        rows = sum(-(-n // row_tokens) for n in plan.lengths)
        lines.append(f"rows:     {rows:,} rows for {len(plan.lengths):,} samples: a sample over row_tokens {row_tokens:,} "
                     f"is stored as rows of at most that many positions (README: Long context)")
    if cfg.backend != "sglang":
        return lines
    opts = cfg.backend_options
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
    free = shutil.disk_usage(opts.get("ring_dir") or shm).free
    ring = int(opts.get("ring_bytes") or min(DEFAULT_RING_BYTES, free // 2))
    chunk = int(opts.get("chunked_prefill_size") or DEFAULT_CHUNK)
    window = (-(-chunk // row_tokens) + 3) * row_tokens
    whole = longest * per_token
    if whole <= ring // 2:
        how = f"held whole in the ring ({whole / 2**30:.2f} GiB of its {ring / 2**30:.2f} GiB)"
    elif window * per_token <= (ring - row_tokens * per_token) // 2:  # as hs_dataset.capture.sglang.ring_client
        how = (f"{whole / 2**30:.2f} GiB of states, passed through a {window:,}-row window of the ring "
               f"({window * per_token / 2**30:.2f} GiB: prefill chunk {chunk:,} + 3 rows; the engine waits while each "
               "row is written)")
    else:
        how = (f"{whole / 2**30:.2f} GiB, and one {window:,}-row window ({window * per_token / 2**30:.2f} GiB) needs "
               f"a ring of {(2 * window + row_tokens) * per_token / 2**30:.2f} GiB, more than {ring / 2**30:.2f} GiB. "
               "Raise backend_options.ring_bytes or lower row_tokens")
    lines.append(f"memory:   the longest sample ({longest:,} tokens) is {how}; /dev/shm free {free / 2**30:.1f} GiB "
                 f"(the ring: backend_options.ring_bytes, default min(8 GiB, half of it))")
    return lines
