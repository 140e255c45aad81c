"""Stage 7, read: builds and versions as torch tensors for training, zero-copy and safe to write to.

* :mod:`.open`: :func:`open_dataset` (a local build mapped in place, a published version on disk once);
* :mod:`.decode`: Arrow rows -> bf16 tensors; :mod:`.safe_views`: copy-on-write views of the shards;
* :mod:`.iterate`: :func:`iter_torch`, with read-ahead; :mod:`.torch_format`: :data:`TORCH_FORMAT`;
* :mod:`.collate`: :class:`DrafterCollator`, EAGLE-3 batches; :mod:`.stats`: what a build holds, in numbers.

The names below are importable from here (``from hs_dataset.read import open_dataset, iter_torch``).
"""

from hs_dataset.read.collate import DrafterCollator
from hs_dataset.read.decode import column_bits, decode_row, decode_state, list_values, state_columns_of
from hs_dataset.read.iterate import READ_AHEAD_BYTES, iter_torch
from hs_dataset.read.open import open_dataset
from hs_dataset.read.torch_format import TORCH_FORMAT

__all__ = ["READ_AHEAD_BYTES", "TORCH_FORMAT", "DrafterCollator", "column_bits", "decode_row", "decode_state",
           "iter_torch", "list_values", "open_dataset", "state_columns_of"]
