"""The capture-backend protocol: what a build asks of a backend (``transformers``, ``sglang``, an
isolated process, an import's file reader).

Every backend captures the layers of :mod:`hs_dataset.model_info`'s convention (layer k = output
of decoder layer k, before any norm) plus the final post-norm state.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Protocol, Union

from hs_dataset.errors import ConfigError
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
    * ``in_pieces`` (optional): True when it can deliver a long sample as several results in order,
      each a piece of ``row_tokens`` positions (:attr:`CaptureResult.token_start`); the build then
      asks for pieces (``capture(samples, row_tokens=..., max_tokens=...)``).
    * ``teachers`` (optional): True when ``capture(samples, teacher_k=K)`` also gives the teacher's top-K of
      every position (:attr:`CaptureResult.teacher`, :mod:`hs_dataset.codec.teacher`).
    * ``without_final`` (optional): True when ``capture(samples, final=False)`` leaves the final state out of
      ``states`` (``[len(layers), T, H]``); the build asks it when it does not store ``hidden_final``. Other
      backends deliver it and the encode stage leaves it out.
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


def start_capture(backend: CaptureBackend, samples: Iterable[TokenizedSample], storage_dtype: StorageDtype, *,
                  row_tokens: int | None = None, max_tokens: int | None = None,
                  teacher_k: int = 0, final: bool = True) -> Iterator[BackendItem]:
    """``backend.capture(samples)``, asking for ``storage_dtype`` when the backend can deliver it, and,
    from a backend that delivers long samples in pieces (``in_pieces``), pieces of ``row_tokens``
    positions (``max_tokens``: the longest sample, checked against its transport up front); with
    ``teacher_k``, the teacher's top-k (a backend without ``teachers`` is refused); ``final=False``: the final
    state is not stored, so a backend that can (``without_final``) leaves it out.

    Raises:
        ConfigError: ``teacher_k`` asked of a backend that cannot compute it.
    """
    kw: dict[str, object] = {}
    if teacher_k:
        if not getattr(backend, "teachers", False):
            raise ConfigError(f"the {getattr(backend, 'name', type(backend).__name__)} backend cannot compute the "
                              "teacher's top-k: use backend transformers or sglang, or leave teacher unset",
                              field="teacher")
        kw["teacher_k"] = teacher_k
    if storage_dtype != "bfloat16" and storage_dtype in getattr(backend, "encodings", ("bfloat16",)):
        kw["encoding"] = storage_dtype
    if not final and getattr(backend, "without_final", False):
        kw["final"] = False
    if getattr(backend, "in_pieces", False) and row_tokens is not None:
        kw.update(row_tokens=row_tokens, max_tokens=max_tokens)
    return backend.capture(samples, **kw)
