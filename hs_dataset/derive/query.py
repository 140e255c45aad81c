"""What a derived version keeps: row filters on tags and statistics, a mix by weight, a sample budget.

A filter is ``COLUMN OP VALUE`` (``OP``: ``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``, ``not in``;
``VALUE`` a Python literal: ``'on'``, ``2``, ``['en', 'fr']``, ``None``) over a row's plain columns (``id``,
``num_tokens``, the ``tag_*`` columns) and its statistics (``stat_*``, :mod:`hs_dataset.integrity.teacher_stats`);
several filters all hold. The mix: version ``i`` gets ``weight_i / sum(weights)`` of the rows; with a
``budget`` of ``B`` rows, ``round(B * share_i)`` of them (at most what its filters keep), else the most rows
that keep the shares. Rows are drawn without replacement by a seeded generator (``seed + i`` for version ``i``)
and kept in their version's order, so the same query gives the same rows.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from hs_dataset.errors import ConfigError

__all__ = ["Filter", "mix_counts", "parse_filter", "row_mask", "sample_rows"]

_FILTER = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(==|!=|<=|>=|<|>|not\s+in|in)\s*(.+?)\s*$")
_OPS = {"==": pc.equal, "!=": pc.not_equal, "<": pc.less, "<=": pc.less_equal, ">": pc.greater,
        ">=": pc.greater_equal}


@dataclass(frozen=True)
class Filter:
    """One ``COLUMN OP VALUE`` condition."""

    column: str
    op: str
    value: object

    def __str__(self) -> str:
        return f"{self.column} {self.op} {self.value!r}"


def parse_filter(text: str) -> Filter:
    """``"tag_mode == 'on'"`` -> a :class:`Filter`.

    Raises:
        ConfigError: not of the form ``COLUMN OP VALUE`` with a Python literal value.
    """
    m = _FILTER.match(text)
    if not m:
        raise ConfigError(f"filter {text!r}: use COLUMN OP VALUE, e.g. \"tag_mode == 'on'\" or 'stat_entropy_mean > 1.5'",
                          field="where", value=text)
    column, op, raw = m.group(1), " ".join(m.group(2).split()), m.group(3)
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare word: text
    if op in ("in", "not in") and not isinstance(value, (list, tuple, set)):
        raise ConfigError(f"filter {text!r}: {op} needs a list, e.g. tag_language in ['en', 'fr']", field="where",
                          value=text)
    return Filter(column, op, value)


def row_mask(table: pa.Table, filters: list[Filter], where: str) -> np.ndarray:
    """Which rows of ``table`` (a version's plain columns and statistics) every filter keeps.

    Raises:
        ConfigError: a filter names a column the version does not have (the columns it has are listed).
    """
    keep = np.ones(table.num_rows, dtype=bool)
    for f in filters:
        if f.column not in table.column_names:
            raise ConfigError(f"filter {f}: {where} has no column {f.column!r} (it has {sorted(table.column_names)}; "
                              "stat_* columns need `hs-dataset verify DIR --stats` first)", field="where", value=str(f))
        col = table.column(f.column)
        if f.op in ("in", "not in"):
            hit = pc.is_in(col, value_set=pa.array(list(f.value), type=col.type))  # type: ignore[call-overload]
            hit = pc.invert(hit) if f.op == "not in" else hit
        elif f.value is None:
            hit = pc.is_null(col) if f.op == "==" else pc.is_valid(col)
        else:
            try:
                hit = _OPS[f.op](col, pa.scalar(f.value, type=col.type))
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
                raise ConfigError(f"filter {f}: {f.value!r} does not compare with {f.column} ({col.type}): {e}",
                                  field="where", value=str(f)) from None
        keep &= np.asarray(pc.fill_null(hit, False).to_numpy(zero_copy_only=False), dtype=bool)
    return keep


def mix_counts(available: list[int], weights: list[float], budget: int | None) -> list[int]:
    """Rows to draw from each version (module docstring).

    Raises:
        ConfigError: a negative or all-zero weight, or weights not one per version.
    """
    if len(weights) != len(available) or any(w < 0 for w in weights) or not sum(weights) > 0:
        raise ConfigError(f"weights {weights}: one non-negative weight per version ({len(available)}), not all 0",
                          field="weights", value=weights)
    share = np.asarray(weights, dtype=float) / float(sum(weights))
    if budget is None:  # the largest mix with these shares
        total = min((a / s for a, s in zip(available, share) if s > 0), default=0.0)
        return [min(a, int(np.floor(total * s + 1e-9))) for a, s in zip(available, share)]
    if budget < 0:
        raise ConfigError(f"budget {budget}: a number of rows, 0 or more", field="budget", value=budget)
    return [min(a, int(round(budget * s))) for a, s in zip(available, share)]


def sample_rows(candidates: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``n`` of ``candidates`` (row indices) drawn without replacement by ``seed``, in ascending order."""
    if n >= len(candidates):
        return np.sort(candidates)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(candidates, size=n, replace=False))
