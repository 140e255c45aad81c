"""The teacher with the output embedding split over TP ranks (SGLang's ``ParallelLMHead`` at ``tp_size > 1``): each
rank's top-k of its rows, merged, is the whole vocabulary's top-k (ties included), log-probs and logsumexp within
float32 rounding; and the plugin's per-pass step (``pass_teachers``) over real ``torch.distributed`` ranks (gloo, one
process a rank) gives rank 0 the teacher of every request that asks for it. The device test at ``tp_size=2`` is
``tests/gpu/test_sglang.py::test_the_plugins_teacher_is_the_references_top_k``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hs_dataset.capture.sglang.teacher_ranks import vocab_shard
from hs_dataset.capture.transport import make_rid
from hs_dataset.codec.teacher_shards import merge_shards, shard_topk

ROOT = Path(__file__).resolve().parents[2]


def sglang_shards(vocab: int, ranks: int) -> list[tuple[int, int, int]]:
    """``(first id, tokens, rows with padding)`` of each rank, by SGLang 0.5.17's ``VocabParallelEmbedding``: the
    vocabulary padded to a multiple of 64 (of 64 * ranks when that does not split evenly), split evenly; a rank's
    tokens are its first rows."""
    pad = 64 if -(-vocab // 64) * 64 % ranks == 0 else 64 * ranks
    per = -(-vocab // pad) * pad // ranks
    return [(min(r * per, vocab), min((r + 1) * per, vocab) - min(r * per, vocab), per) for r in range(ranks)]


def model(vocab: int, hidden: int = 32, rows: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 final states and output embedding with exact ties: tokens 5 and ``vocab - 3`` (in other ranks' rows),
    and 7 and 8, have the same embedding, a multiple of the first axis (a product with no rounding); one state is
    zero (every logit 0: the lowest ids first)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) * 0.1
    w[5] = w[vocab - 3] = torch.nn.functional.one_hot(torch.tensor(0), hidden) * 8.0
    w[7] = w[8] = torch.nn.functional.one_hot(torch.tensor(1), hidden) * 6.0
    final = torch.randn(rows, hidden, generator=g)
    final[:10, 0] = 4.0  # the tie of 5 and vocab - 3 on top
    final[10:20, 1] = 5.0  # the tie of 7 and 8 on top
    final[20] = 0.0
    return final.to(torch.bfloat16), w.to(torch.bfloat16)


def logits_of(final: torch.Tensor, weight: torch.Tensor, shards) -> torch.Tensor:
    """The whole vocabulary's logits from the same products the ranks compute (one per rank's rows), float32."""
    return torch.cat([torch.nn.functional.linear(final, weight[a:a + n]).float() for a, n, _ in shards], dim=1)


def assert_whole_vocabularys(ids, logprobs, lse, logits: torch.Tensor, k: int) -> None:
    """``(ids, logprobs, lse)`` is the top-k of ``logits``: the logsumexp and the k highest log-probs within 1e-5,
    each id a token of that logit (k distinct ones), and the same ids in the same order wherever the value is above
    the k-th (the lower id first among tied values). At the k-th value itself a tie may take any of the tied ids:
    PyTorch's ``topk`` (each rank's on the CPU path) does not say which; the GPU path's kernel takes the lower."""
    r_lse = torch.logsumexp(logits, -1)
    order = torch.tensor([sorted(range(len(row)), key=lambda j: (-row[j], j))[:k] for row in logits.tolist()])
    r_vals = logits.gather(1, order)
    assert torch.allclose(lse, r_lse, rtol=0, atol=1e-5)
    assert torch.allclose(logprobs, r_vals - r_lse[:, None], rtol=0, atol=1e-5)
    assert torch.equal(logits.gather(1, ids.long()), r_vals)  # each id's logit is its place's value
    assert all(len(set(row)) == k for row in ids.tolist())
    above = r_vals > r_vals[:, -1:]
    assert torch.equal(ids[above], order.to(torch.int32)[above])


def padded_weight(weight: torch.Tensor, start: int, n: int, rows: int) -> torch.Tensor:
    """A rank's embedding as SGLang holds it: its tokens' rows, then padding rows (huge values here: a teacher that
    read them would take them first)."""
    pad = torch.full((rows - n, weight.shape[1]), 50.0, dtype=weight.dtype)
    return torch.cat([weight[start:start + n], pad])


@pytest.mark.parametrize("vocab,ranks,k", [(1003, 3, 8), (50, 8, 8), (1000, 2, 64), (300, 4, 1)])
def test_the_ranks_top_k_merged_is_the_whole_vocabularys(vocab, ranks, k):
    """Every rank's part (``shard_topk``), stacked in rank order as an all-gather gives them, merged: the same ids as
    the whole vocabulary's top-k, ties by the lower id (tokens 5 and vocab - 3 sit in different ranks), log-probs and
    logsumexp within 1e-5. (50, 8): rank 7 holds no token and rank 6 two, fewer than k."""
    final, weight = model(vocab)
    shards = sglang_shards(vocab, ranks)
    assert sum(n for _, n, _ in shards) == vocab and (vocab != 50 or shards[7][1] == 0)
    spans = [(0, 7), (7, 20), (30, 10)]  # three requests of a pass, back to back (27..29 belong to none)
    rows = [r for off, n in spans for r in range(off, off + n)]
    parts = []
    for start, n, padded in shards:
        lm_head = SimpleNamespace(tp_size=ranks, weight=padded_weight(weight, start, n, padded),
                                  shard_indices=SimpleNamespace(org_vocab_start_index=start,
                                                                org_vocab_end_index=start + n))
        assert vocab_shard(lm_head, vocab) == (start, n)
        parts.append(shard_topk(final, lm_head.weight[:n], start, spans, k))
    ids, logprobs, lse = merge_shards(torch.cat(parts), ranks, k)
    assert_whole_vocabularys(ids, logprobs, lse, logits_of(final[rows], weight, shards), k)
    if k > 1:
        assert ids[:7, :2].tolist() == [[5, vocab - 3]] * 7  # a tie across ranks: the lower id first
        assert ids[7:10, :2].tolist() == [[5, vocab - 3]] * 3 and ids[10:20, :2].tolist() == [[7, 8]] * 10
    zero = rows.index(20)  # every logit 0
    assert abs(float(lse[zero]) - torch.log(torch.tensor(float(vocab))).item()) < 1e-5


def test_a_whole_embedding_is_not_split():
    assert vocab_shard(SimpleNamespace(tp_size=1, weight=torch.zeros(4, 2)), 4) is None
    assert vocab_shard(SimpleNamespace(weight=torch.zeros(4, 2)), 4) is None  # a plain linear layer


# One TP rank: pass_teachers of one pass over gloo (the plugin's all-gather is SGLang's TP group's, on the GPU)
_RANK = r"""
import json, sys
from types import SimpleNamespace
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from tests.codec.test_teacher_shards import model, padded_weight, sglang_shards
from hs_dataset.capture.sglang.teacher_ranks import pass_teachers

rank, world, store, out, vocab = int(sys.argv[1]), int(sys.argv[2]), sys.argv[4], sys.argv[5], int(sys.argv[6])
batch = json.loads(sys.argv[7])
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world)
final, weight = model(vocab)
start, n, padded = sglang_shards(vocab, world)[rank]
lm_head = SimpleNamespace(tp_size=world, weight=padded_weight(weight, start, n, padded),
                          shard_indices=SimpleNamespace(org_vocab_start_index=start, org_vocab_end_index=start + n))
fb = SimpleNamespace(rids=batch["rids"], extend_seq_lens_cpu=batch["lens"], extend_prefix_lens_cpu=batch["prefix"])

def all_gather(t):
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)

got = pass_teachers(fb, final, lm_head, "hsds-", vocab, world, rank, all_gather)
torch.save(got, out)
dist.destroy_process_group()
"""


def test_pass_teachers_over_gloo_ranks_gives_rank_0_each_asking_requests_teacher(tmp_path):
    """Three processes, one a rank, each with its part of the embedding (and padding rows): one pass of five requests,
    two not ours or without teacher, one asking top-8 and two top-5 (in one all-gather at k = 8). Rank 0 gets each
    asking request's teacher of its rows, equal to the whole vocabulary's; the others get ``{}``."""
    vocab, world = 1003, 3
    rids = ["other-1", make_rid("hsds-", "abc", 1, 8), make_rid("hsds-", "abc", 2), make_rid("hsds-", "abc", 3, 5),
            make_rid("hsds-", "abc-k9", 4, 5)]
    lens, prefix = [4, 9, 6, 11, 10], [0, 128, 0, 0, 3]
    batch = json.dumps({"rids": rids, "lens": lens, "prefix": prefix})
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo")  # the ranks talk over the loopback
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(world), str(ROOT), str(tmp_path / "store"),
                               str(tmp_path / f"rank{r}.pt"), str(vocab), batch], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-2000:]
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert got[1] == {} and got[2] == {}
    final, weight = model(vocab)
    shards = sglang_shards(vocab, world)
    assert sorted(got[0]) == sorted([rids[1], rids[3], rids[4]])
    offsets = [sum(lens[:i]) for i in range(len(lens))]
    for i, k in ((1, 8), (3, 5), (4, 5)):
        ids, lp, lse = got[0][rids[i]]
        assert ids.shape == (lens[i], k) and ids.is_contiguous() and lp.is_contiguous()
        assert_whole_vocabularys(ids, lp, lse, logits_of(final[offsets[i]:offsets[i] + lens[i]], weight, shards), k)
