"""scan_state's PyTorch path (the CPU's, and the reference of the GPU kernel: tests/gpu/test_state_scan.py):
one call gives the NaN/Inf tokens, the fp8 encoding and the statistics of both encodings."""

from __future__ import annotations

import pytest
import torch

from hs_dataset.codec.fp8 import fp8_quantize
from hs_dataset.codec.state_scan import scan_state
from hs_dataset.codec.state_stats import token_stats
from tests.codec.test_state_stats import states


def test_one_call_gives_the_nonfinite_tokens_the_fp8_encoding_and_both_statistics():
    x = states(40, 512)
    x[7, 3], x[9, 0], x[11, 511] = float("nan"), float("inf"), -float("inf")
    s = scan_state(x, fp8=True)
    assert s.nonfinite.nonzero().flatten().tolist() == [7, 9, 11]
    q, sc = fp8_quantize(x)
    ok = ~s.nonfinite  # NaN != NaN: the tokens that are never stored are left out of the comparisons
    assert s.fp8 is not None and torch.equal(s.fp8[0], q) and torch.equal(s.fp8[1][ok], sc[ok])
    assert torch.equal(s.stats(fp8=False)[ok], token_stats(x)[ok])
    assert torch.equal(s.stats(fp8=True)[ok], token_stats(q, sc)[ok])
    only = scan_state(x)
    assert only.fp8 is None and torch.equal(only.bf16_stats[ok], s.bf16_stats[ok])
    with pytest.raises(ValueError, match="fp8=True"):
        only.stats(fp8=True)
