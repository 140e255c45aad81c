"""``TORCH_FORMAT``: a ``datasets`` format whose rows are what :func:`hs_dataset.read.iterate.iter_torch` gives.

``ds.with_format(TORCH_FORMAT)`` (map-style or streaming) makes ``ds[i]``, ``ds[i:j]``,
``ds.iter(n)``, ``for row in ds`` and a ``torch.utils.data.DataLoader`` over ``ds`` yield bf16 torch
tensors, safe to write to (:mod:`hs_dataset.read.safe_views`), plus the plain columns (``num_tokens``)
as Python values. ``ds.with_format(TORCH_FORMAT, fp8="codes")``: an fp8 build's states as their stored
codes and scales (:func:`~hs_dataset.read.decode.decode_row`), decoded on the GPU by
:func:`~hs_dataset.read.collate.decode_on`. ``with_format("torch")`` instead gives int64 copies of the
stored uint16 bits, and a ``set_transform`` function gets Python lists (14.7 M Python ints per Kimi state).

The format is registered with ``datasets`` when this module is imported, which
:mod:`hs_dataset.read` and :mod:`hs_dataset.read.collate` do: a ``DataLoader`` worker started bare
(``spawn``) has it as soon as it unpickles its ``DrafterCollator``.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from datasets import formatting

from hs_dataset.layout import scale_column
from hs_dataset.read.decode import check_fp8_mode, decode_row, state_columns_of
from hs_dataset.read.safe_views import SafeViews

__all__ = ["TORCH_FORMAT"]

TORCH_FORMAT = "hs_dataset.torch"


class _TorchFormatter(formatting.Formatter):
    """Rows as :func:`~hs_dataset.read.decode.decode_row` gives them, plus the other plain columns as Python
    values; batches and columns as per-row lists. ``fp8``: as :func:`~hs_dataset.read.decode.decode_row`'s."""

    def __init__(self, *args: Any, fp8: str = "decode", **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fp8 = check_fp8_mode(fp8)

    def format_row(self, pa_table: pa.Table) -> dict[str, Any]:
        return self._rows(pa_table.slice(0, 1))[0]

    def format_batch(self, pa_table: pa.Table) -> dict[str, list[Any]]:
        rows = self._rows(pa_table)
        return {c: [r[c] for r in rows] for c in (rows[0] if rows else pa_table.column_names)}

    def format_column(self, pa_table: pa.Table) -> list[Any]:
        return self.format_batch(pa_table)[pa_table.column_names[0]]

    def _rows(self, table: pa.Table) -> list[dict[str, Any]]:
        states = state_columns_of(table)
        skip = set(states) | {scale_column(c) for c in states}
        rows = []
        with SafeViews() as views:
            for i in range(table.num_rows):
                row = decode_row(table, i, views=views, fp8=self.fp8)
                for c in table.column_names:
                    if c not in row and c not in skip:
                        row[c] = table.column(c)[i].as_py()
                rows.append(row)
        return rows


_register = getattr(formatting, "_register_formatter", None)  # datasets' own registry (no public one)
if _register is not None and TORCH_FORMAT not in getattr(formatting, "_FORMAT_TYPES", {}):
    _register(_TorchFormatter, TORCH_FORMAT)
