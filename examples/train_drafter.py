"""Train a tiny EAGLE-3-style draft head on a hidden-states dataset, on the CPU, in seconds.

    hs-dataset build builder_scripts/tiny_demo.py --output demo_out
    python examples/train_drafter.py demo_out --steps 40
    python examples/train_drafter.py org/name --revision v1.0     # a published version

The data is read where it is: a build directory is memory-mapped in place, a published version is
downloaded once (resumable, every shard checked against its recorded hash) and mapped there; either
way at most one copy of the data is on disk (``hs_dataset.read.open_dataset``; ``load_dataset(dir)``
would first convert the whole build into the ``datasets`` cache, a second copy).

    # or train while it builds: start both; the trainer gets each row as the build makes it
    hs-dataset build builder_scripts/tiny_demo.py --output demo_out --stream &
    python examples/train_drafter.py demo_out --steps 40 --stream

What each column does (EAGLE-3, one step of its training-time test):

* ``aux_hidden_states`` (the captured layers, concatenated by ``DrafterCollator``): the draft head's
  input, through ``fc`` (n*H -> H), joined with the embedding of the next token (``input_ids``,
  the target's frozen ``embed_tokens``) and run through one decoder layer;
* ``hidden_states`` (``hidden_final``, the target's last post-norm state): the frozen target
  ``lm_head`` on it gives the target's next-token distribution, the draft's training target (so no
  logits need to be stored);
* ``loss_mask``: the positions that count (the assistant replies).

The draft at position t predicts the target's distribution at t + 1 from aux(t) and token t + 1.
Prints one JSON line per step: the soft cross-entropy ``loss`` and its part that training can
remove, ``kl`` = KL(target || draft) = loss - the target's entropy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch.utils.data import DataLoader

from hs_dataset.layout import layer_of
from hs_dataset.read import TORCH_FORMAT, DrafterCollator, open_dataset
from hs_dataset.stream import open_stream


class DraftHead(torch.nn.Module):
    """fc over the aux states + the next token's embedding -> one causal decoder layer -> norm."""

    def __init__(self, hidden: int, n_aux: int, embed: torch.Tensor, heads: int = 4):
        super().__init__()
        self.embed = torch.nn.Embedding.from_pretrained(embed, freeze=True)
        self.fc = torch.nn.Linear(n_aux * hidden, hidden, bias=False)
        self.join = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = torch.nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True,
                                                      norm_first=True)
        self.norm = torch.nn.RMSNorm(hidden)

    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        x = self.join(torch.cat([self.embed(next_ids), self.fc(aux)], dim=-1))
        causal = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.norm(self.layer(x, src_mask=causal, is_causal=True))


def build_info(data: Path) -> tuple[Path, int]:
    """The target model's directory and the number of captured layers: hs_dataset.json's, or while the
    build still runs (--stream) its .hs_build/build.json."""
    meta = data / "hs_dataset.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        return Path(m["model"]["path"]), len(m["layers"])
    m = json.loads((data / ".hs_build" / "build.json").read_text())
    return Path(m["model"]), len(m["layers"])


def target_weights(data: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target model's embedding and lm_head (float32), from its safetensors (path in hs_dataset.json)."""
    model = build_info(data)[0]
    tensors = {}
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k.endswith("embed_tokens.weight") or k.endswith("lm_head.weight"):  # also language_model.*
                    tensors[k.split(".")[-2]] = st.get_tensor(k).float()
    return tensors["embed_tokens"], tensors.get("lm_head", tensors["embed_tokens"])  # tied: lm_head = embedding


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="a build directory (hs-dataset build --output), or a published version's repo (org/name)")
    ap.add_argument("--revision", default=None, help="the version of a repo (default: main, the newest)")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=256, help="tokens per sample trained on")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--stream", action="store_true",
                    help="train while it builds: read the build as it runs (hs-dataset build ... --stream), then "
                         "its finished version (README: Train while it builds)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)

    collate = DrafterCollator(max_length=a.max_length)
    if a.stream:  # epoch 0 as the build makes the rows, later epochs from the version, seeded
        folder = Path(a.data)
        while not (folder / ".hs_build" / "build.json").exists() and not (folder / "hs_dataset.json").exists():
            time.sleep(0.1)  # the build has not started yet
        loader = DataLoader(open_stream(folder, seed=0), batch_size=a.batch, collate_fn=collate)
        n_layers = build_info(folder)[1]
    else:
        ds = open_dataset(a.data, revision=a.revision).with_format(TORCH_FORMAT)  # rows of bf16 tensors, zero-copy
        n_layers = len([c for c in ds.column_names if layer_of(c) is not None])  # not the fp8 *_scale columns
        folder = Path(ds.cache_files[0]["filename"]).parent.parent  # the build (or download) folder
        loader = DataLoader(ds, batch_size=a.batch, shuffle=True, collate_fn=collate,
                            generator=torch.Generator().manual_seed(0), num_workers=a.workers,
                            persistent_workers=a.workers > 0)
    embed, lm_head = target_weights(folder)
    draft = DraftHead(embed.shape[1], n_layers, embed)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=a.lr)

    losses: list[float] = []
    while len(losses) < a.steps:
        for batch in loader:
            aux = batch["aux_hidden_states"][:, :-1].float()  # [B, T-1, n*H] at position t
            next_ids = batch["input_ids"][:, 1:]  # token t + 1
            with torch.no_grad():  # the target's distribution at t + 1
                target = torch.softmax(batch["hidden_states"][:, 1:].float() @ lm_head.T, dim=-1)
            logp = torch.log_softmax(draft(aux, next_ids) @ lm_head.T, dim=-1)
            mask = batch["loss_mask"][:, 1:].float()
            n = mask.sum().clamp(min=1)
            loss = -((target * logp).sum(-1) * mask).sum() / n  # soft cross-entropy
            entropy = -((target * target.clamp(min=1e-30).log()).sum(-1) * mask).sum() / n
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            print(json.dumps({"step": len(losses), "loss": round(losses[-1], 5),
                              "kl": round(losses[-1] - entropy.item(), 5)}), flush=True)
            if len(losses) == a.steps:
                break
    return losses


if __name__ == "__main__":
    main()
