"""An fp8 build read as its stored codes (``fp8="codes"``) and decoded on the trainer's device (``decode_on``): the
same bf16 bits as the host's decode, through ``iter_torch``, ``TORCH_FORMAT``, the padded and packed collators and
DataLoader workers; a bf16 build reads the same either way. (On a GPU: tests/gpu/test_decode_on.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from hs_dataset.codec.fp8 import fp8_dequantize
from hs_dataset.layout import scale_column
from hs_dataset.read import TORCH_FORMAT, DrafterCollator, iter_torch, open_dataset
from hs_dataset.read.collate import decode_on
from hs_dataset.write.driver import build
from tests.fixtures.builds import config

STATES = ("hidden_layer_0", "hidden_layer_1", "hidden_layer_2", "hidden_final")


@pytest.fixture(scope="module")
def builds(tiny_model, backend, tmp_path_factory) -> dict[str, Path]:
    """12 demo samples of different lengths, fp8 (with a teacher) and bf16."""
    d = tmp_path_factory.mktemp("fp8-codes")
    out = {}
    for dtype, extra in (("fp8_e4m3", {"teacher": "topk:4"}), ("bfloat16", {})):
        out[dtype] = d / dtype
        build(config(tiny_model, storage_dtype=dtype, max_samples=12, **extra), out[dtype], backend=backend,
              progress=False)
    return out


def test_codes_are_the_stored_bits_and_scales_and_decode_to_the_host_decode(builds):
    ds = open_dataset(builds["fp8_e4m3"])
    decoded, codes = list(iter_torch(ds)), list(iter_torch(ds, fp8="codes"))
    assert len(decoded) == len(codes) == 12 and len({len(r["input_ids"]) for r in codes}) > 1
    for d, c in zip(decoded, codes):
        assert [k for k in d if k not in c] == []
        for s in STATES:
            assert c[s].dtype == torch.float8_e4m3fn and c[scale_column(s)].dtype == torch.float32
            assert c[s].shape == d[s].shape and c[scale_column(s)].shape == d[s].shape[:1]
            assert torch.equal(fp8_dequantize(c[s].view(torch.uint8), c[scale_column(s)]).view(torch.int16),
                               d[s].view(torch.int16))
        assert torch.equal(c["teacher_ids"], d["teacher_ids"]) and torch.equal(c["input_ids"], d["input_ids"])
    plain = open_dataset(builds["bfloat16"])
    for d, c in zip(iter_torch(plain), iter_torch(plain, fp8="codes")):  # bf16: nothing to decode, the same rows
        assert d.keys() == c.keys() and all(torch.equal(c[s], d[s]) for s in STATES)
    with pytest.raises(ValueError, match="'decode'.*'codes'"):
        next(iter_torch(ds, fp8="bits"))


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_batch_of_codes_decoded_on_the_device_is_the_batch_of_decoded_samples(builds, packed):
    ds = open_dataset(builds["fp8_e4m3"])
    decoded, codes = list(iter_torch(ds)), list(iter_torch(ds, fp8="codes"))
    for a in range(0, 12, 5):  # batches of 5, 5 and 2 samples of different lengths (padding)
        want = DrafterCollator(packed=packed)(decoded[a:a + 5])
        batch = DrafterCollator(packed=packed)(codes[a:a + 5])
        assert batch["aux_hidden_states"].dtype == torch.float8_e4m3fn
        assert batch["aux_hidden_scales"].shape == batch["aux_hidden_states"].shape[:2] + (3,)
        assert batch["aux_hidden_states"].nbytes * 2 == want["aux_hidden_states"].nbytes  # half the bytes to move
        got = decode_on(batch, "cpu")
        assert got.keys() == want.keys()
        for k, v in want.items():
            g = got[k]
            assert g.dtype == v.dtype and g.shape == v.shape, k
            assert torch.equal(g.view(torch.int16), v.view(torch.int16)) if v.dtype == torch.bfloat16 else \
                torch.equal(g, v) or (v.is_floating_point() and torch.equal(g.nan_to_num(), v.nan_to_num())), k


def test_dataloader_workers_hand_over_codes_in_shared_memory(builds):
    """``with_format(TORCH_FORMAT, fp8="codes")`` in spawned DataLoader workers: the batch's codes are made in the
    worker's shared memory (handed over, not copied), and decode to the host-decoded batch."""
    ds = open_dataset(builds["fp8_e4m3"])
    ref = list(iter_torch(ds))
    loader = DataLoader(ds.with_format(TORCH_FORMAT, fp8="codes"), batch_size=4, num_workers=1,
                        collate_fn=DrafterCollator(), multiprocessing_context="spawn")
    n = 0
    for k, batch in enumerate(loader):
        assert batch["aux_hidden_states"].is_shared() and batch["aux_hidden_states"].dtype == torch.float8_e4m3fn
        want = DrafterCollator()(ref[4 * k:4 * k + 4])
        got = decode_on(batch, "cpu")
        for key in ("aux_hidden_states", "hidden_states"):
            assert torch.equal(got[key].view(torch.int16), want[key].view(torch.int16)), key
        n += 1
    assert n == 3
