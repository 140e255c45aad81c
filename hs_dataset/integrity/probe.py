"""``hs-dataset verify TARGET --probe N``: N stored rows re-run through the reference backend and compared.

Checksums prove the bytes are the bytes written; the probe checks they are the right states for the
right sample. It draws N rows (``seed``; the ids are printed and recorded), reads them from only the
shards that hold them (a local build, or a published version: just those shards are downloaded, each
checked against its recorded hash), runs their stored token ids through the transformers backend on
the device at hand (CUDA when there is one), and compares every stored state column with the
reference (:mod:`hs_dataset.integrity.parity`: mean token cosine, relative error, every token's
cosine, per storage dtype). A row that does not match is explained where it can be: NaN/Inf values,
a state shifted by one token, the states of another probed sample, positions not computed. Each row's
token ids and loss mask are also compared with what its source row gives today (a regenerate build:
its stored conversation): a sample cut short, another sample's tokens, a mask that differs.

The result goes into ``hs_dataset.json`` (``probe``) and the card of a local build
(:func:`record_probe`), and from there into every version pushed from it; ``verify`` then reports a
failed probe's rows as problems (naming the part to rebuild), so ``push`` refuses them. It needs the
model's weights (``model``, default: the path the build recorded) and holds the N rows twice in memory
(stored and recomputed): at Kimi-K2.5's width and 2048 tokens, 64 rows are about 15 GB.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from hs_dataset._version import __version__
from hs_dataset.capture.transformers import TransformersBackend
from hs_dataset.errors import MissingPathError
from hs_dataset.integrity.parity import THRESHOLDS, Thresholds, compare, explain_shift
from hs_dataset.integrity.probe_inputs import Expected, StoredRow, expected_tokens, pick_rows, probe_config, read_rows
from hs_dataset.integrity.scan import Found
from hs_dataset.layout import DATA_DIR, state_columns
from hs_dataset.records import TokenizedSample
from hs_dataset.write.resolve import resolve_build

__all__ = ["ProbeReport", "RowProbe", "run_probe"]


@dataclass
class RowProbe:
    """One probed row: where it is, its per-column parity, and what is wrong with it (empty: nothing)."""

    row: int
    sample_id: str
    shard: str
    part: int | None
    tokens: int
    columns: dict[str, dict[str, float]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class ProbeReport:
    """The probe's outcome; ``ok`` when every probed row matches. ``to_record()`` is what ``hs_dataset.json`` keeps."""

    where: str
    seed: int
    storage_dtype: str
    thresholds: Thresholds
    device: str
    model: str
    tokens_checked: str
    rows: list[RowProbe] = field(default_factory=list)
    seconds: float = 0.0
    reference_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def failed(self) -> list[RowProbe]:
        return [r for r in self.rows if not r.ok]

    def found(self) -> list[Found]:
        """The failed rows as problems of ``verify`` (the shard, what is wrong, the part to rebuild)."""
        return [(f"{DATA_DIR}/{r.shard}", f"probe: row {r.row} ({r.sample_id}): {p}", r.part)
                for r in self.failed for p in r.problems]

    def summary(self) -> dict[str, dict[str, float]]:
        """Per column, the worst row: the lowest mean cosine and the highest relative error."""
        out: dict[str, dict[str, float]] = {}
        for r in self.rows:
            for c, p in r.columns.items():
                s = out.setdefault(c, {"mean_cos": 1.0, "rel_err": 0.0})
                s["mean_cos"] = min(s["mean_cos"], p["mean_cos"])
                s["rel_err"] = max(s["rel_err"], p["rel_err"])
        return out

    def message(self) -> str:
        """What was probed and the outcome, one line per failed row."""
        ids = ", ".join(f"{r.row} ({r.sample_id})" for r in self.rows[:64])
        more = f" and {len(self.rows) - 64} more" if len(self.rows) > 64 else ""
        head = (f"probe of {self.where}: {len(self.rows)} rows (seed {self.seed}): {ids}{more}\n"
                f"probe: re-ran them through transformers on {self.device} ({self.model}) in {self.seconds:.1f}s "
                f"({self.reference_seconds:.1f}s of forward passes); {self.tokens_checked}")
        th = self.thresholds
        if self.ok:
            worst = self.summary()
            cos = min((s["mean_cos"] for s in worst.values()), default=1.0)
            err = max((s["rel_err"] for s in worst.values()), default=0.0)
            return (f"{head}\nprobe: all {len(self.rows)} rows match the reference ({self.storage_dtype}: mean cosine "
                    f">= {th.mean_cos}, relative error <= {th.rel_err:.0%}; worst {cos:.5f}, {err:.2%})")
        lines = [f"  row {r.row} ({r.sample_id}, {r.shard}): " + "; ".join(r.problems) for r in self.failed]
        return f"{head}\nprobe: {len(self.failed)} of {len(self.rows)} rows do not match:\n" + "\n".join(lines)

    def to_record(self) -> dict[str, Any]:
        return {"ok": self.ok, "rows": len(self.rows), "seed": self.seed, "where": self.where,
                "backend": "transformers", "device": self.device, "model": self.model,
                "storage_dtype": self.storage_dtype, "thresholds": self.thresholds.to_dict(),
                "tokens_checked": self.tokens_checked, "seconds": round(self.seconds, 2),
                "reference_seconds": round(self.reference_seconds, 2), "worst": self.summary(),
                "probed": [[r.row, r.sample_id] for r in self.rows],
                "failed": [{"row": r.row, "id": r.sample_id, "shard": r.shard, "part": r.part, "problems": r.problems}
                           for r in self.failed],
                "hs_dataset": __version__, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _check_tokens(r: StoredRow, expected: Expected | None) -> list[str]:
    """The stored tokens and mask of ``r`` against its source's (``expected``: every probed sample's, or None
    when the source could not be read)."""
    ids, n = r.input_ids.astype(np.int64), len(r.input_ids)
    out = []
    if r.num_tokens != n or len(r.loss_mask) != n or any(s.shape[0] != n for s in r.states.values()):
        out.append(f"num_tokens {r.num_tokens}, {n} token ids, {len(r.loss_mask)} mask values, state rows "
                   f"{sorted({s.shape[0] for s in r.states.values()})}: they must all be equal")
    if expected is None:
        return out
    want = expected.get(r.sample_id)
    if want is None:
        return out + ["its sample id is not among its source's rows (the source changed, or the id is not its own)"]
    if isinstance(want, str):
        return out + [f"its source row gives no sample now ({want})"]
    exp = want.input_ids.astype(np.int64)
    if np.array_equal(ids, exp):
        if not np.array_equal(r.loss_mask.astype(np.uint8), want.loss_mask.astype(np.uint8)):
            diff = np.flatnonzero(r.loss_mask.astype(np.uint8) != want.loss_mask.astype(np.uint8))
            out.append(f"its loss mask differs from its source row's at {diff.size} positions (from {int(diff[0])})")
        return out
    if n < len(exp) and np.array_equal(ids, exp[:n]):
        out.append(f"cut short: it holds the first {n} of the {len(exp)} tokens its source row gives")
        return out
    owner = [sid for sid, s in expected.items() if sid != r.sample_id and not isinstance(s, str)
             and np.array_equal(s.input_ids.astype(np.int64), ids)]
    if owner:
        out.append(f"it holds the token ids of sample {owner[0]}, not its own")
    else:
        m = min(n, len(exp))
        first = int(np.flatnonzero(ids[:m] != exp[:m])[0]) if (ids[:m] != exp[:m]).any() else m
        out.append(f"its {n} token ids differ from the {len(exp)} its source row gives (from position {first})")
    return out


def _check_states(r: StoredRow, ref: torch.Tensor, columns: list[str], th: Thresholds, rp: RowProbe) -> list[str]:
    """Compare every column; -> the columns left unexplained (their problems are added to ``rp`` later)."""
    failing = []
    for j, c in enumerate(columns):
        if r.states[c].shape != ref[j].shape:
            rp.problems.append(f"{c} is {tuple(r.states[c].shape)}, the reference {tuple(ref[j].shape)}")
            continue
        p = compare(r.states[c], ref[j], th)
        rp.columns[c] = p.to_dict()
        if p.ok(th):
            continue
        if p.nonfinite or (p.mean_cos >= th.mean_cos and p.rel_err <= th.rel_err):
            rp.problems.append(f"{c}: {p.what(th)}")
        else:
            failing.append((j, c, p))
    shifts = {explain_shift(r.states[c], ref[j], th) for j, c, _ in failing}
    if failing and len(shifts) == 1 and 0 not in shifts:
        side = "t + 1" if shifts == {1} else "t - 1"
        rp.problems.append(f"{', '.join(c for _, c, _ in failing)} shifted by one token: stored position t holds the "
                           f"reference's {side}")
        return []
    return [c for _, c, _ in failing]


def run_probe(meta: dict[str, Any], where: str, n: int, shard_path: Callable[[dict[str, Any]], Path], *, seed: int = 0,
              model: str | None = None, source: str | None = None, device: str | None = None,
              batch_tokens: int = 8192) -> ProbeReport:
    """Probe ``n`` rows of the build ``meta`` describes (see the module docstring).

    Args:
        meta: its ``hs_dataset.json``; where: how to name it.
        n: rows to probe (all of them when the build has fewer).
        shard_path: a recorded shard entry -> its local file (downloaded where needed).
        seed: which rows.
        model: the model directory (default: the one the build recorded).
        source: the source to retokenize (default: the one the build recorded).
        device: for the reference backend (default: cuda when available).
        batch_tokens: padded tokens per forward pass.

    Raises:
        MissingPathError: the model directory is not here.
    """
    t0 = time.time()
    model = model or str((meta.get("model") or {}).get("path") or "")
    if not (Path(model) / "config.json").is_file():
        raise MissingPathError(f"the probe needs the model's weights: {model or '(none recorded)'} holds no config.json; "
                               "pass --model DIR (the model the build ran)", path=model)
    dtype = str(meta.get("storage_dtype", "bfloat16"))
    th = THRESHOLDS[dtype]
    columns = list(meta.get("columns") or state_columns(meta["layers"]))  # store_final=false: no hidden_final
    rows = read_rows(meta, pick_rows(int(meta["counts"]["written"]), n, seed), shard_path)
    resolved = resolve_build(probe_config(meta, model, source), with_source=False)  # the source may not be here
    expected, checked = expected_tokens(resolved.config, resolved.tokenizer, resolved.vocab_size, rows)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = ProbeReport(where, seed, dtype, th, device, model, checked)
    backend = TransformersBackend(resolved.info, meta["layers"], device=device, batch_tokens=batch_tokens,
                                  trust_remote_code=resolved.config.trust_remote_code)
    refs: dict[int, torch.Tensor] = {}
    unexplained: dict[int, list[str]] = {}
    try:
        t1 = time.time()
        samples = [TokenizedSample(r.sample_id, r.input_ids.astype(np.int32), r.loss_mask.astype(np.uint8)) for r in rows]
        results = list(backend.capture(samples))
        report.reference_seconds = time.time() - t1
    finally:
        backend.close()
    for r, res in zip(rows, results):
        rp = RowProbe(r.row, r.sample_id, r.shard, r.part, r.num_tokens)
        report.rows.append(rp)
        rp.problems += _check_tokens(r, expected)
        if not hasattr(res, "states"):  # a reject: no tokens to run
            rp.problems.append(f"the reference backend cannot run it ({getattr(res, 'reason', res)})")
            continue
        refs[r.row] = res.states
        left = _check_states(r, res.states, columns, th, rp)
        if left:
            unexplained[r.row] = left
    by_row = {r.row: r for r in rows}
    for rp in report.rows:
        if rp.row in unexplained:
            rp.problems.append(_whose(by_row[rp.row], unexplained[rp.row], refs, by_row, columns, th, rp))
    report.seconds = time.time() - t0
    return report


_GLANCE = 64  # positions compared first when looking for whose states a row holds


def _whose(r: StoredRow, failing: list[str], refs: dict[int, torch.Tensor], rows: dict[int, StoredRow],
           columns: list[str], th: Thresholds, rp: RowProbe) -> str:
    """Whose states ``r`` holds, among the other probed rows (compared over their common prefix)."""
    first = columns.index(failing[0])
    for other, ref in refs.items():
        if other == r.row:
            continue
        n = min(r.num_tokens, ref.shape[1])
        m = min(n, _GLANCE)
        if not n or not compare(r.states[failing[0]][:m], ref[first][:m], th).ok(th):
            continue  # a glance at the first positions rules most rows out (a build whose every row fails: n^2)
        if all(compare(r.states[c][:n], ref[columns.index(c)][:n], th).ok(th) for c in failing):
            return (f"{', '.join(failing)} hold the states of sample {rows[other].sample_id} (row {other}; over the "
                    f"{n} positions both have), not its own")
    worst = "; ".join(f"{c}: mean cosine {rp.columns[c]['mean_cos']:.4f}, relative error {rp.columns[c]['rel_err']:.1%}"
                      for c in failing if c in rp.columns)
    return f"{worst}: not its states (not one token off, not another probed sample's)"
