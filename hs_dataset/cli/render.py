"""Text the commands print: sizes, tables, a length histogram, the reject breakdown."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from hs_dataset.write.card import human_bytes
from hs_dataset.write.rejects import group_rejects

if TYPE_CHECKING:
    import numpy as np

__all__ = ["duplicates_line", "histogram", "print_rejects", "size", "table"]


def size(n: float | None) -> str:
    """``5.10 MiB``: bytes in binary units (``n/a`` for None)."""

    return "n/a" if n is None else human_bytes(n).split(" (")[0]


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], indent: str = "  ") -> list[str]:
    """Rows as aligned text columns (numbers right-aligned)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) for i in range(len(header))]
    out = []
    for r in cells:
        out.append(indent + "  ".join(c.rjust(w) if num else c.ljust(w)
                                      for c, w, num in zip(r, widths, numeric)).rstrip())
    return out


def _is_number(text: str) -> bool:
    return text.replace(",", "").replace(".", "").replace("-", "").replace("%", "").isdigit()


def histogram(values: Sequence[int] | np.ndarray, bins: int = 8, width: int = 40) -> list[str]:
    """A text histogram of token lengths: one line per bin, ``lo-hi  ████ count``."""
    import numpy as np  # deferred: the command line starts without numpy

    v = np.asarray(values, dtype=np.int64)
    if v.size == 0:
        return ["  (no samples)"]
    lo, hi = int(v.min()), int(v.max())
    edges = np.unique(np.linspace(lo, hi + 1, num=min(bins, hi - lo + 1) + 1).astype(np.int64))
    counts, _ = np.histogram(v, bins=edges)
    top = max(int(counts.max()), 1)
    label_w = len(f"{edges[-1] - 1:,}") * 2 + 1
    lines = []
    for a, b, c in zip(edges[:-1], edges[1:], counts):
        label = f"{a:,}-{b - 1:,}".rjust(label_w)
        lines.append(f"  {label} {'█' * max(int(round(c / top * width)), 1 if c else 0):<{width}} {c:,}")
    return lines


def print_rejects(rejects: list[dict], total: int, *, most: int = 8, file=None) -> None:
    """The reject breakdown (grouped by :func:`hs_dataset.write.rejects.group_rejects`), most common first."""

    file = file or sys.stdout
    groups = group_rejects(rejects)
    if not groups:
        print(f"rejects:   none (of {total:,} samples)", file=file)
        return
    share = len(rejects) / max(total, 1)
    print(f"rejects:   {len(rejects):,} of {total:,} samples ({share:.1%}), by reason:", file=file)
    # the example's own reason: its numbers say what was wrong (the group's reason has them folded to N)
    rows = [(f"{g.count:,}", g.stage, f"{g.field}: {g.example_reason or g.reason}"[:160], g.example[:60])
            for g in groups[:most]]
    for line in table(("count", "stage", "field: reason (of the sample named)", "e.g. sample"), rows):
        print(line, file=file)
    if len(groups) > most:
        print(f"  ... and {len(groups) - most} more kinds", file=file)


def duplicates_line(same_ids: int, same_rows: int, tokens: int, policy: str, *, skipped: int = 0,
                    prefill: str | None = None, written: bool = False) -> str:
    """``duplicates: ...``: samples repeating an earlier sample's token ids (``same_rows`` of them with its
    loss mask too), what they cost (``prefill``: the time, where a rate is known) and what the build does."""
    whose = "written samples" if written else "samples"
    if not same_ids and not skipped:
        return "duplicates: none (no sample repeats an earlier sample's token ids)"
    cost = f"{tokens:,} tokens" + (f", {prefill} of prefill" if prefill else "")
    head = f"duplicates: {same_ids:,} {whose} repeat an earlier sample's token ids ({same_rows:,} with its loss mask " \
           f"too: identical rows; {cost})"
    if policy == "keep":
        return f"{head}; kept, captured again (duplicates=keep, the default; --duplicates skip leaves the identical " \
               "ones out)"
    left = f"{skipped:,} identical rows left out" if written else f"the {same_rows:,} identical rows are left out"
    return f"{head}; duplicates=skip: {left} (rejects of stage duplicate)"


def print_versions(where: str, versions: Sequence[Any], fmt: str, columns: Sequence[str],
                   row: Any) -> None:
    """A listing of versions (the Hub's or a store's): JSON records, a line when there are none, or a table of
    ``columns`` with ``row(version)`` for each."""
    if fmt == "json":
        print(json.dumps([{k: v for k, v in dataclasses.asdict(x).items() if k != "metadata"} for x in versions],
                         indent=1))
        return
    if not versions:
        print(f"{where}: no versions yet (push one: hs-dataset push DIR {where} --version v1.0)")
        return
    print(f"{where}: {len(versions)} version{'s' * (len(versions) != 1)}")
    for line in table(columns, [row(v) for v in versions]):
        print(line)
