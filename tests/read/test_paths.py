"""Every training path gives the same rows (issue 28): open_dataset map-style and streaming (the mapped shards as
an IterableDataset), iter_torch and TORCH_FORMAT, DataLoader workers over both; a worker writes its batches into
shared-memory buffers it reuses only once the training process has dropped every tensor over them."""

from __future__ import annotations

import datasets
import pytest
import torch
from torch.utils.data import DataLoader

from hs_dataset.read import TORCH_FORMAT, DrafterCollator, iter_torch, open_dataset
from tests.fixtures.builds import random_build

BATCH = 2


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """40 samples of 64 tokens in 5 shards (parts of 8): 20 batches, 10 per worker of 2."""
    return random_build(tmp_path_factory.mktemp("paths"), samples=40, tokens=64, hidden=256, part_size=8)


@pytest.fixture(scope="module")
def ref(build) -> list[dict]:
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in r.items()}
            for r in iter_torch(open_dataset(build), prefetch=0)]


def same_row(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k]
                                        for k, v in a.items())


def test_streaming_is_the_mapped_shards_as_an_iterable_dataset(build, ref):
    stream = open_dataset(build, streaming=True)
    assert isinstance(stream, datasets.IterableDataset) and stream.num_shards == 5  # one per shard file
    assert open_dataset(build, streaming=True, num_shards=40).num_shards == 40
    for rows in (iter_torch(stream, batch_size=3), iter_torch(stream, prefetch=0), iter(stream.with_format(TORCH_FORMAT))):
        got = list(rows)
        assert len(got) == 40 and all(same_row({k: v for k, v in g.items() if k in r}, r) for g, r in zip(got, ref))
    first = next(iter(stream.with_format(TORCH_FORMAT)))
    assert first["hidden_final"].dtype == torch.bfloat16
    shuffled = [r["id"] for r in stream.shuffle(seed=1, buffer_size=8)]
    assert sorted(shuffled) == sorted(r["id"] for r in ref) and shuffled != [r["id"] for r in ref]


class Recording(DrafterCollator):
    """Adds to each batch the worker's buffer count, the buffer index it used (-1: fresh memory) and the worker."""

    def __call__(self, samples):
        batch = super().__call__(samples)
        release = getattr(batch, "_release", None)
        info = torch.utils.data.get_worker_info()
        batch["buffers"] = torch.tensor([len(self._shared.storages) if self._shared else 0,
                                         release[1] if release else -2, info.id if info else -1])
        return batch


def check(batch: dict, rows: list[dict]) -> None:
    expected = DrafterCollator(reuse_buffers=False)(rows)
    for k, v in expected.items():
        assert torch.equal(batch[k], v), k


@pytest.mark.parametrize("streaming", [False, True])
def test_worker_buffers_are_reused_once_the_trainer_drops_a_batch(build, ref, streaming):
    ds = (open_dataset(build, streaming=True) if streaming else open_dataset(build)).with_format(TORCH_FORMAT)
    by_id = {r["id"]: r for r in ref}
    loader = DataLoader(ds, batch_size=BATCH, num_workers=2, collate_fn=Recording(),
                        **({} if streaming else {"shuffle": True, "generator": torch.Generator().manual_seed(0)}))
    used, seen, workers = [], [], []
    for batch in loader:  # the trainer drops each batch before the next: the workers' buffers come back
        assert batch["aux_hidden_states"].is_shared()
        count, index, worker = batch["buffers"].tolist()
        used.append(index)
        workers.append(worker)
        assert count <= 4 and index >= -1, (count, index)
        ids = [next(r["id"] for r in ref if torch.equal(batch["input_ids"][b], r["input_ids"].long()))
               for b in range(BATCH)]
        check(batch, [by_id[i] for i in ids])
        seen += ids
        del batch
    assert sorted(seen) == sorted(by_id) and len(used) == 20
    # a worker takes fresh memory only when every one of its 4 buffers is in flight or held. Map-style, the
    # sampler's batches alternate between the workers: never. Streaming, 5 shards over 2 workers give them 12
    # and 8 batches: once the one with 8 has ended, the other has all of the DataLoader's 4 batches in flight
    # plus the one the trainer holds, and may take fresh memory, only then.
    fresh = [k for k, index in enumerate(used) if index == -1]
    ended = max(k for k, w in enumerate(workers) if w != workers[-1])
    assert all(k > ended for k in fresh) if streaming else not fresh, (used, workers)
    kept = [index for index in used if index >= 0]
    assert len(kept) > len(set(kept))  # 20 batches through at most 4 buffers per worker


def test_batches_the_trainer_holds_are_never_written_over(build, ref):
    loader = DataLoader(open_dataset(build).with_format(TORCH_FORMAT), batch_size=BATCH, num_workers=2,
                        collate_fn=Recording(), multiprocessing_context="spawn")
    held = list(loader)  # every batch kept: no buffer comes back, later batches take fresh memory
    assert len(held) == 20 and min(int(b["buffers"][1]) for b in held) == -1
    for k, batch in enumerate(held):
        check(batch, ref[BATCH * k:BATCH * (k + 1)])
    views = [b["aux_hidden_states"][:, :8] for b in DataLoader(
        open_dataset(build).with_format(TORCH_FORMAT), batch_size=BATCH, num_workers=2, collate_fn=Recording())]
    for k, v in enumerate(views):  # a view alone keeps a buffer: it is never written over either
        assert torch.equal(v, DrafterCollator(reuse_buffers=False)(ref[BATCH * k:BATCH * (k + 1)])["aux_hidden_states"][:, :8])


def test_no_worker_buffers_gives_fresh_memory_for_every_batch(build, ref):
    loader = DataLoader(open_dataset(build).with_format(TORCH_FORMAT), batch_size=BATCH, num_workers=2,
                        collate_fn=DrafterCollator(worker_buffers=0))
    for k, batch in enumerate(loader):
        assert batch["aux_hidden_states"].is_shared() and type(batch) is dict
        check(batch, ref[BATCH * k:BATCH * (k + 1)])
