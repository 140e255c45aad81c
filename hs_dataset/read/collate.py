"""Decoded samples -> EAGLE-3 training batches, with one copy of each hidden state.

Two layouts, the ones the drafter trainers consume:

* padded ``[B, T, ...]`` (the default), SpecForge's: its offline ``OfflineEagle3Dataset`` +
  ``DataCollatorWithPadding`` pad every sample to the longest one of the batch (``hidden_state`` =
  the aux layers concatenated ``[B, T, 3H]``, ``target`` = the final state ``[B, T, H]``);
* packed ``[1, L, ...]`` (``packed=True``), vLLM speculators': its ``create_collate_fn``
  concatenates the samples along the sequence (``hidden_states`` = aux ``[1, L, 3H]``,
  ``verifier_last_hidden_states`` = final) with per-sample ``lengths`` and ``position_ids``. No
  padding is written at all; a padded layout can be made from it on the GPU.

In a ``DataLoader`` worker the batch is written into shared memory, as ``default_collate`` does, so
handing it to the training process copies nothing; each worker reuses a few such buffers once the
training process has dropped the batches in them (:mod:`hs_dataset.read.worker_batches`).

Samples of an fp8 build read with ``fp8="codes"`` (``iter_torch``, ``TORCH_FORMAT``) give batches of the
stored codes (``torch.float8_e4m3fn``, half the bytes of bf16) and their scales, which :func:`decode_on`
moves to the trainer's GPU and decodes there: no decode on the host, half the bytes over PCIe.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import torch

# registers TORCH_FORMAT: a bare (spawned) DataLoader worker unpickling a collator has it
import hs_dataset.read.torch_format  # noqa: F401
from hs_dataset.codec.fp8 import fp8_dequantize
from hs_dataset.layout import (FINAL_COLUMN, TEACHER_IDS_COLUMN, TEACHER_LOGPROBS_COLUMN, TEACHER_LSE_COLUMN, layer_of,
                               scale_column)
from hs_dataset.read.safe_views import libc_madvise
from hs_dataset.read.worker_batches import SharedBatch, WorkerBuffers

__all__ = ["DrafterCollator", "decode_on", "empty_batch_tensor"]

_MADV_HUGEPAGE = 14
# buffers kept per state in the training process: the batch a training loop still holds while it asks for the
# next one (``for batch in loader`` rebinds ``batch`` only after), and one to write that next one into
_POOL_DEPTH = 2
_HUGE_MIN_BYTES = 8 << 20


def empty_batch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` for a large batch buffer, backed by transparent huge pages where Linux allows.

    A fresh 100+ MB batch costs one page fault per 4 KiB on its first write, and on a VM those
    faults cost about as much as reading the bytes from disk; ``MADV_HUGEPAGE`` (honoured when
    ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``) maps it 2 MiB at a
    time. A no-op on other systems, for small tensors, or if the call fails. In a ``DataLoader``
    worker the tensor is allocated in shared memory instead.
    """
    if _in_worker():
        t = torch.empty((0,), dtype=dtype)
        storage = torch.UntypedStorage._new_shared(math.prod(shape) * t.element_size())
        return t.set_(storage, 0, shape)  # type: ignore[call-overload]  # the stub wants a stride; torch does not
    t = torch.empty(shape, dtype=dtype)
    n = t.numel() * t.element_size()
    madvise = libc_madvise() if n >= _HUGE_MIN_BYTES else None
    if madvise:
        a = t.data_ptr()
        start = (a + 4095) & ~4095
        madvise(start, (a + n - start) & ~4095, _MADV_HUGEPAGE)
    return t


def _in_worker() -> bool:
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


_BITS = {2: torch.int16, 1: torch.int8}  # a state's element size -> the integer type numpy copies it as


def _copy_states(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for CPU state tensors of one dtype (bf16, or fp8 codes), as one numpy copy.

    torch's copy of a [T, H] slab into a strided batch slice runs on its intra-op threads, which
    on a 2-vCPU machine is 3x slower than a single memcpy-speed loop (measured 4.6-6.6 vs 18 GB/s
    for a 235 MB Kimi batch); numpy copies 2-byte elements with a plain strided memcpy loop.
    """
    bits = _BITS.get(dst.element_size())
    if dst.dtype == src.dtype and bits is not None and dst.device.type == src.device.type == "cpu":
        np.copyto(dst.view(bits).numpy(), src.view(bits).numpy())
    else:
        dst.copy_(src)


def _unreferenced(t: torch.Tensor, python_refs: int) -> bool:
    """True when nothing but the caller holds ``t``: no other Python reference, no view, no numpy
    array on its memory, and its storage was never moved to shared memory (DataLoader workers)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or sys.getrefcount(t) != python_refs + 2:  # + this frame + getrefcount
        return False
    st = t.untyped_storage()
    return not st.is_shared() and use_count(st._cdata) == 2  # the tensor + ``st``


class DrafterCollator:
    """Batches decoded samples (``iter_torch`` rows, or ``ds[i]`` in :data:`~hs_dataset.read.TORCH_FORMAT`).

    Padded (default) output: ``input_ids`` (int64 [B, T]), ``attention_mask`` and ``loss_mask``
    (int64 [B, T]), ``hidden_states`` (the final post-norm state, bf16 [B, T, H]) and
    ``aux_hidden_states`` (the captured layers concatenated in ascending order, bf16 [B, T, n*H],
    SpecForge's layout). Packed (``packed=True``) output: ``input_ids``, ``loss_mask`` and
    ``position_ids`` (int64 [1, L], L = the sum of the lengths), ``cu_seqlens`` (int32 [B + 1], the
    sample boundaries, as flash-attention's varlen kernels take them), ``hidden_states`` [1, L, H]
    and ``aux_hidden_states`` [1, L, n*H]. Each state is copied once, straight into its place. A build
    without ``hidden_final`` (``store_final=False``) has no ``hidden_states``; a teacher build adds, at
    every position, ``teacher_ids`` (int64 [B, T, k], -1 where the loss mask is 0), ``teacher_logprobs``
    (float32 [B, T, k], -inf there) and ``teacher_lse`` (float32 [B, T]); :func:`hs_dataset.read.teacher.draft_target`
    turns them into the distillation target over a draft vocabulary.

    Args:
        max_length: cut each sample to its first ``max_length`` tokens.
        pad_token_id: ``input_ids`` of padding positions (padded layout).
        reuse_buffers: the two state buffers of a batch are reused for a later batch that fits in them once
            nothing references them any more (the batch and every view of it are gone, and they were not
            handed to another process); two of each are kept, as large as the largest batch yet, so that a
            training loop holding the last batch while it asks for the next still reuses them: at Kimi
            shapes a batch is 100s of MB, and fresh memory costs a page fault per 4 KiB (on this VM about
            as much as reading the bytes from disk).
        packed: the packed layout instead of the padded one.
        worker_buffers: in a DataLoader worker, the shared-memory batch buffers it keeps and reuses once the
            training process has dropped every tensor of the batch in one (0: fresh memory per batch; measured:
            README, "Load for training"). Each is as large as the largest batch yet; default 4 = the 2 batches
            a worker has in flight by default (``prefetch_factor``), one the trainer holds, one being written.

    Raises:
        ValueError: on an empty batch.
    """

    def __init__(self, max_length: int | None = None, pad_token_id: int = 0, reuse_buffers: bool = True,
                 packed: bool = False, worker_buffers: int = 4):
        self.max_length = max_length
        self.pad_token_id = pad_token_id
        self.reuse_buffers = reuse_buffers
        self.packed = packed
        self.worker_buffers = worker_buffers
        self._pool: dict[str, list[torch.Tensor]] = {}
        self._shared: WorkerBuffers | None = None

    def __getstate__(self) -> dict[str, Any]:  # a DataLoader worker gets the settings, not the buffers
        return {**self.__dict__, "_pool": {}, "_shared": None}

    def _states(self, B: int, T: int, H: int, n: int, final: bool,
                dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor, int]:
        """The state buffers of a batch, ``[B, T, H]`` (None without ``final``) and ``[B, T, n*H]`` of ``dtype``, and
        the worker buffer index holding them (-1: none)."""
        if not (_in_worker() and self.worker_buffers > 0):
            return (self._buffer("hidden_states", (B, T, H), dtype) if final else None,
                    self._buffer("aux_hidden_states", (B, T, n * H), dtype), -1)
        if self._shared is None:
            self._shared = WorkerBuffers(self.worker_buffers)
        size = torch.empty((), dtype=dtype).element_size()
        index, storage = self._shared.take(B * T * (n + int(final)) * H * size)
        aux = torch.empty((0,), dtype=dtype).set_(storage, 0, (B, T, n * H))  # type: ignore[call-overload]
        last = torch.empty((0,), dtype=dtype).set_(storage, B * T * n * H, (B, T, H)) if final else None  # type: ignore[call-overload]
        return last, aux, index

    def _buffer(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A ``shape`` view of a pooled buffer nothing references any more, or of a fresh one (kept when there is room)."""
        n = math.prod(shape)
        if not self.reuse_buffers:
            return empty_batch_tensor(shape, dtype)
        pool = self._pool.setdefault(f"{key}:{dtype}", [])
        pool[:] = [t for t in pool if not t.untyped_storage().is_shared()]  # handed to another process: never free here
        for i in range(len(pool)):
            if pool[i].numel() >= n and _unreferenced(pool[i], python_refs=1):
                return pool[i][:n].view(shape)
        flat = empty_batch_tensor((max([n] + [t.numel() for t in pool]),), dtype)  # as large as the largest yet
        if len(pool) < _POOL_DEPTH:
            pool.append(flat)
        else:
            small = [i for i in range(len(pool)) if _unreferenced(pool[i], python_refs=1)]
            if small:  # a free buffer too small for this batch: replaced by a larger one
                pool[small[0]] = flat
        return flat[:n].view(shape)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("DrafterCollator got an empty batch")
        layer_cols = sorted((c for c in samples[0] if layer_of(c) is not None), key=lambda c: layer_of(c) or 0)
        lens = [min(int(s["input_ids"].shape[0]), self.max_length or 1 << 62) for s in samples]
        final = FINAL_COLUMN in samples[0]
        first = samples[0][FINAL_COLUMN if final else layer_cols[0]]
        H, dtype = first.shape[-1], first.dtype
        codes = dtype == torch.float8_e4m3fn  # fp8="codes": the stored codes, and their scales beside them
        if self.packed:
            starts = np.concatenate(([0], np.cumsum(lens)))
            rows = [(0, int(a), n) for a, n in zip(starts, lens)]
            B, T = 1, int(starts[-1])
        else:
            rows = [(b, 0, n) for b, n in enumerate(lens)]
            B, T = len(samples), max(lens)
        small = torch.full if not _in_worker() else _shared_full
        batch = {
            "input_ids": small((B, T), self.pad_token_id, dtype=torch.long),
            "loss_mask": small((B, T), 0, dtype=torch.long),
        }
        # not zeroed: every position is written below, the padding with zeros
        last, batch["aux_hidden_states"], index = self._states(B, T, H, len(layer_cols), final, dtype)
        if last is not None:
            batch["hidden_states"] = last
        if codes:
            batch["aux_hidden_scales"] = small((B, T, len(layer_cols)), 0, dtype=torch.float32)
            if final:
                batch["hidden_scales"] = small((B, T), 0, dtype=torch.float32)
        if TEACHER_IDS_COLUMN in samples[0]:
            k = samples[0][TEACHER_IDS_COLUMN].shape[-1]
            batch["teacher_ids"] = torch.full((B, T, k), -1, dtype=torch.long)
            batch["teacher_logprobs"] = torch.full((B, T, k), -math.inf, dtype=torch.float32)
            batch["teacher_lse"] = torch.full((B, T), math.nan, dtype=torch.float32)
        if self.packed:
            batch["position_ids"] = small((B, T), 0, dtype=torch.long)
            batch["cu_seqlens"] = torch.from_numpy(starts.astype(np.int32))
        else:
            batch["attention_mask"] = small((B, T), 0, dtype=torch.long)
        for s, (b, a, n) in zip(samples, rows):
            batch["input_ids"][b, a:a + n] = s["input_ids"][:n]
            batch["loss_mask"][b, a:a + n] = s["loss_mask"][:n]
            if self.packed:
                batch["position_ids"][b, a:a + n] = torch.arange(n)
            else:
                batch["attention_mask"][b, :n] = 1
            if final:
                _copy_states(batch["hidden_states"][b, a:a + n], s[FINAL_COLUMN][:n])
                if codes:
                    batch["hidden_scales"][b, a:a + n] = s[scale_column(FINAL_COLUMN)][:n]
            for j, c in enumerate(layer_cols):
                _copy_states(batch["aux_hidden_states"][b, a:a + n, j * H:(j + 1) * H], s[c][:n])
                if codes:
                    batch["aux_hidden_scales"][b, a:a + n, j] = s[scale_column(c)][:n]
            if not self.packed and n < T:
                if final:
                    batch["hidden_states"][b, n:] = 0
                batch["aux_hidden_states"][b, n:] = 0
            if "teacher_ids" in batch:  # stored at the masked positions, in order: put back at their positions
                pos = torch.nonzero(torch.as_tensor(s["loss_mask"]) != 0).flatten()
                keep = pos < n
                at = a + pos[keep]
                batch["teacher_ids"][b, at] = s[TEACHER_IDS_COLUMN][keep].long()
                batch["teacher_logprobs"][b, at] = s[TEACHER_LOGPROBS_COLUMN][keep]
                batch["teacher_lse"][b, at] = s[TEACHER_LSE_COLUMN][keep]
        if self._shared is not None:
            return SharedBatch(batch, self._shared, index, "aux_hidden_states")
        return batch


def _shared_full(shape: tuple[int, ...], value: int, dtype: torch.dtype) -> torch.Tensor:
    return empty_batch_tensor(shape, dtype).fill_(value)


def decode_on(batch: dict[str, torch.Tensor], device: torch.device | str,
              non_blocking: bool = True) -> dict[str, torch.Tensor]:
    """``batch`` (a :class:`DrafterCollator` batch) on ``device``, its fp8 states decoded to bf16 there.

    A batch of fp8 codes (samples read with ``fp8="codes"``) becomes the batch of bf16 states the decoded samples
    give, bit for bit (:func:`hs_dataset.codec.fp8.fp8_dequantize` on ``device``: ``bfloat16(float32(code) *
    scale)``); the ``*_scales`` entries are used up. Other tensors (and a bf16 batch) are only moved.
    ``non_blocking``: copies from pinned memory (``DataLoader(pin_memory=True)``) overlap the GPU's work. On the
    host (``device="cpu"``) it decodes as ``fp8="decode"`` would have, after the collation.
    """
    out = {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items() if not k.endswith("_scales")}
    for key, scales in (("aux_hidden_states", "aux_hidden_scales"), ("hidden_states", "hidden_scales")):
        if scales not in batch:
            continue
        codes, scale = out[key], batch[scales].to(device, non_blocking=non_blocking)
        if scale.dim() == codes.dim() - 1:  # one state: [B, T, H] with [B, T]
            scale = scale[..., None]
        per = codes.view(torch.uint8).view(*codes.shape[:-1], scale.shape[-1], -1)  # [B, T, n, H]
        out[key] = fp8_dequantize(per, scale).view(codes.shape)
    return out
