"""The capture-backend protocol: what a build asks of a backend (``transformers``, ``sglang``, an
isolated process, an import's file reader).

Every backend captures the layers of :mod:`hs_dataset.model_info`'s convention (layer k = output
of decoder layer k, before any norm) plus the final post-norm state.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Protocol, Union

from hs_dataset.layout import StorageDtype
from hs_dataset.model_info import ModelInfo
from hs_dataset.records import CaptureResult, Reject, TokenizedSample

__all__ = ["BackendItem", "CaptureBackend", "start_capture"]


BackendItem = Union[CaptureResult, Reject]


class CaptureBackend(Protocol):
    """Produces hidden states for tokenized samples.

    ``capture`` consumes samples lazily and yields, **in input order**, one item per sample: a
    :class:`CaptureResult` (``states`` on the CPU, ``[len(layers)+1, T, H]``, bf16 or as asked by
    ``encoding``) or a :class:`Reject` for a sample the backend cannot run (e.g. longer than the
    engine allows). A backend-wide failure (engine died, hang) raises :class:`BackendError`.

    What the build asks of a backend besides ``capture``:

    * ``continuous``: True when its engine batches continuously, by timing, so grouping samples
      into calls fixes nothing about the result; the build then feeds it one ``capture`` call across
      all parts. Otherwise each part gets its own call, so that a resumed part is batched exactly
      as in an uninterrupted build.
    * ``encodings``: the storage encodings it can deliver itself; for one other than
      ``"bfloat16"`` the build calls ``capture(samples, encoding=...)`` (the SGLang backend quantizes
      fp8 on the GPU); for the rest the encode stage converts.
    * ``versions()``: package versions recorded in ``hs_dataset.json``; ``close()``.
    """

    name: str
    info: ModelInfo
    layers: tuple[int, ...]
    continuous: bool
    encodings: tuple[StorageDtype, ...]

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[BackendItem]: ...

    def versions(self) -> dict[str, str]: ...

    def close(self) -> None: ...


def start_capture(backend: CaptureBackend, samples: Iterable[TokenizedSample],
                  storage_dtype: StorageDtype) -> Iterator[BackendItem]:
    """``backend.capture(samples)``, asking for ``storage_dtype`` when the backend can deliver it."""
    if storage_dtype != "bfloat16" and storage_dtype in getattr(backend, "encodings", ("bfloat16",)):
        return backend.capture(samples, encoding=storage_dtype)  # type: ignore[call-arg]
    return backend.capture(samples)
