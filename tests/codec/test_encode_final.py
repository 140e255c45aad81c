"""A backend asked for no final state (start_capture's ``final=False``, the SGLang ring's slots without it): the
encode stage writes the same row as from states with the final state, and refuses such states for a build that
stores hidden_final, naming the column."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np
import pytest
import torch

from hs_dataset.capture.base import start_capture
from hs_dataset.codec.encode import encode_row
from hs_dataset.errors import SampleError
from hs_dataset.records import CaptureResult, TokenizedSample

LAYERS = (1, 3)


def result(states: torch.Tensor) -> CaptureResult:
    T = states.shape[1]
    sample = TokenizedSample("s0", np.arange(T, dtype=np.int32), np.ones(T, dtype=np.uint8))
    g = torch.Generator().manual_seed(1)
    teacher = (torch.randint(0, 50, (T, 4), generator=g, dtype=torch.int32), -torch.rand((T, 4), generator=g),
               torch.rand((T,), generator=g))
    return CaptureResult(sample=sample, layers=LAYERS, states=states, nonfinite=(0,) * states.shape[0], teacher=teacher)


def test_states_without_the_final_one_encode_as_a_build_without_hidden_final():
    full = torch.randn((len(LAYERS) + 1, 6, 8), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for dtype in ("bfloat16", "fp8_e4m3"):
        want = encode_row(result(full), dtype, store_final=False, teacher=True)
        got = encode_row(result(full[:len(LAYERS)].clone()), dtype, store_final=False, teacher=True)
        assert "hidden_final" not in got and set(got) == set(want)
        for k, v in want.items():
            assert np.array_equal(np.asarray(got[k]), np.asarray(v)), k
    with pytest.raises(SampleError) as e:
        encode_row(result(full[:len(LAYERS)].clone()), "bfloat16", store_final=True)
    assert e.value.field == "hidden_final" and "without the final" in e.value.reason


class _Backend:
    """The capture protocol's keywords as a backend receives them (what start_capture decides)."""

    name = "kw"
    teachers = True

    def __init__(self, without_final: bool):
        self.without_final = without_final
        self.asked: dict[str, Any] = {}

    def capture(self, samples: Iterable[TokenizedSample], **kw: Any) -> Iterator[Any]:
        self.asked = kw
        return iter(())


def test_start_capture_asks_for_no_final_state_only_of_a_backend_that_can_leave_it_out():
    for can in (True, False):
        for final in (True, False):
            be = _Backend(can)
            list(start_capture(be, [], "bfloat16", teacher_k=4, final=final))  # type: ignore[arg-type]
            assert be.asked.get("final", True) is (final or not can)
            assert be.asked["teacher_k"] == 4
