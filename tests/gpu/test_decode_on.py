"""A batch of fp8 codes decoded on the GPU (``hs_dataset.read.collate.decode_on``) is the host's decode, bit for bit:
every code (NaN codes included), scales from 1e-40 to 3e38, Kimi-K2.5's width (3 aux states + final, 7,168)."""

from __future__ import annotations

import torch

from hs_dataset.read.collate import decode_on
from tests.gpu.models import GPU_MARKS

pytestmark = GPU_MARKS


def test_the_gpu_decodes_a_batch_of_codes_as_the_host_does():
    g = torch.Generator().manual_seed(0)
    B, T, H, n = 2, 1024, 7168, 3
    codes = torch.randint(0, 256, (B, T, n * H), generator=g, dtype=torch.uint8)
    codes[0, 0, :256] = torch.arange(256, dtype=torch.uint8)  # every code
    final = torch.randint(0, 256, (B, T, H), generator=g, dtype=torch.uint8)
    scales = torch.logspace(-40, 38, B * T * n).reshape(B, T, n)[:, torch.randperm(T, generator=g)].float()
    scales[1, -5:] = 0  # padding
    batch = {"input_ids": torch.zeros((B, T), dtype=torch.long),
             "aux_hidden_states": codes.view(torch.float8_e4m3fn), "aux_hidden_scales": scales,
             "hidden_states": final.view(torch.float8_e4m3fn), "hidden_scales": scales[..., 0].contiguous()}
    host = decode_on(batch, "cpu")
    gpu = decode_on({k: v.pin_memory() for k, v in batch.items()}, "cuda")
    torch.cuda.synchronize()
    for key in ("aux_hidden_states", "hidden_states"):
        h, d = host[key], gpu[key].cpu()
        assert d.dtype == h.dtype == torch.bfloat16 and d.shape == h.shape
        nan = h.isnan()
        assert torch.equal(nan, d.isnan()), key
        assert torch.equal(h.view(torch.int16)[~nan], d.view(torch.int16)[~nan]), key
    assert set(gpu) == {"input_ids", "aux_hidden_states", "hidden_states"}
