"""Do all files of an import folder come from one model and one layer set? Checked before an import writes anything.

The model check (:mod:`hs_dataset.interop.model_check`) recomputes a few files spread over the folder
(:func:`spread`); a folder mixing two models (or two layer sets) of the same shapes would pass it whenever the odd
files are not among them. So every file also gets a cheap fingerprint, per stored state: the mean over its tokens
(``[H]``: a model's residual stream has the same large channels whatever the text) and the median token norm
(the sink token's outlier left out; over the loss-masked positions). A file's fingerprint is compared with the
reference, the mean of the files the model check verified (the folder's median when it was skipped): a per-state
cosine below
:data:`MIN_MEAN_COSINE` (another model: near 0) or a median norm off by more than a factor ``exp(``
:data:`MAX_LOG_NORM` ``)`` (another layer: the stream grows layer by layer) marks the file odd, and the import is
refused naming the odd files. On the tiny test models (``tests/interop/test_import_checks.py``): files of the
same model and layers >= 0.27 cosine and <= 0.19 log-norm, another model's <= 0 cosine, the neighbouring layers'
>= 0.34 log-norm.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from hs_dataset.errors import InteropError

__all__ = ["MAX_LOG_NORM", "MIN_MEAN_COSINE", "FileFingerprint", "check_same_source", "fingerprint", "spread"]

MIN_MEAN_COSINE = 0.15
MAX_LOG_NORM = 0.3

FileFingerprint = tuple[torch.Tensor, torch.Tensor]  # per state: mean over tokens [S, H], median token norm [S]


def spread(items: Sequence[int], n: int) -> list[int]:
    """``n`` of ``items`` spread evenly over them (the first and the last included)."""
    if len(items) <= n:
        return list(items)
    if n == 1:
        return [items[0]]
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def fingerprint(states: torch.Tensor, loss_mask: torch.Tensor | None = None) -> FileFingerprint:
    """A file's fingerprint from its states ``[S, T, H]``: the mean over every position (a mean over few positions
    is noise), the median norm over the loss-masked ones (all when none is: a padded batch's tail, SpecForge's,
    left out)."""
    x = states.float()
    norms = x.norm(dim=-1)
    if loss_mask is not None and bool(loss_mask.bool().any()):
        norms = norms[:, loss_mask.bool()]
    return x.mean(dim=1), norms.median(dim=1).values


def check_same_source(prints: dict[str, FileFingerprint], reference: Iterable[str], names: Sequence[str],
                      folder: str) -> str:
    """Refuse a folder whose files do not all match the reference files' fingerprint -> what was checked (one line).

    Args:
        prints: each usable file's fingerprint, by its path.
        reference: the files the model check verified (empty: the folder's median is the reference).
        names: the stored states' names (``hidden_layer_K``..., ``hidden_final``).
        folder: the import folder, for the message.

    Raises:
        InteropError: odd files, named (at most 5, then a count).
    """
    ref = [p for p in reference if p in prints]
    if ref:
        means = torch.stack([prints[p][0] for p in ref]).mean(0)
        norms = torch.stack([prints[p][1] for p in ref]).mean(0)
    else:
        means = torch.stack([v[0] for v in prints.values()]).median(0).values
        norms = torch.stack([v[1] for v in prints.values()]).median(0).values
    odd: list[str] = []
    worst_cos, worst_norm = 1.0, 0.0
    for path, (m, n) in prints.items():
        cos = torch.nn.functional.cosine_similarity(m, means, dim=-1)
        log_norm = (n.clamp(min=1e-30) / norms.clamp(min=1e-30)).log().abs()
        j, k = int(cos.argmin()), int(log_norm.argmax())
        if float(cos[j]) < MIN_MEAN_COSINE or float(log_norm[k]) > MAX_LOG_NORM:
            what = (f"{names[j]} mean cosine {float(cos[j]):.2f}" if float(cos[j]) < MIN_MEAN_COSINE
                    else f"{names[k]} norm x{float(n[k] / norms[k].clamp(min=1e-30)):.2f}")
            odd.append(f"{path} ({what})")
        else:
            worst_cos, worst_norm = min(worst_cos, float(cos.min())), max(worst_norm, float(log_norm.max()))
    against = f"the {len(ref)} files the model check verified" if ref else "the folder's median"
    if odd:
        shown = ", ".join(odd[:5]) + (f" and {len(odd) - 5} more" if len(odd) > 5 else "")
        raise InteropError(f"{folder} mixes files of another model or layer set: {len(odd)} of {len(prints)} files "
                           f"differ from {against}: {shown} (a match: mean cosine >= {MIN_MEAN_COSINE}, norm within "
                           f"x{torch.tensor(MAX_LOG_NORM).exp().item():.2f}); move them out of the folder, or import "
                           "them on their own with their --model and --layers")
    return (f"every file ({len(prints)}) matches {against} (per-state mean cosine >= {worst_cos:.2f}, median norm "
            f"within x{torch.tensor(worst_norm).exp().item():.2f})")
