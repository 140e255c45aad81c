"""The capture-backend protocol, and the layer index convention shared by every backend.

Layer index convention
----------------------
``layer k`` (0-based) is the **output of decoder layer k**: the residual stream after layer k
has added its attention and MLP outputs, before any normalisation. In HF transformers terms it
is ``outputs.hidden_states[k + 1]`` for ``k <= num_layers - 2`` (``hidden_states[0]`` is the
embedding output) and the last decoder layer's own output for ``k = num_layers - 1``. In SGLang
terms it is the aux hidden state captured at the input of decoder layer ``k + 1``, and for
``k = num_layers - 1`` the input of the model's final norm (vLLM and speculators store this
pre-norm state as their "last layer"). Valid k: ``0 <= k <= num_layers - 1``.

Every dataset also stores the ``final`` state: the last decoder layer's output **after** the
model's final norm (HF ``last_hidden_state``); EAGLE-3 trainers apply the frozen ``lm_head`` to it.

This differs from SGLang's ``set_eagle3_layers_to_capture(ids)``, which adds 1 to every id in
``llama.py`` and only when ``ids[0] == 1`` in ``deepseek_v2.py``: hs_dataset never passes ids
through that method; the SGLang backend sets the captured positions itself (see
:mod:`hs_dataset.sglang_plugin`), and the GPU parity test pins both backends to this convention.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator, Protocol, Union

from ..errors import BackendError, ConfigError, MissingPathError
from ..records import CaptureResult, Reject, TokenizedSample

__all__ = ["LAYER_CONVENTION", "BackendError", "BackendItem", "CaptureBackend", "ModelInfo", "check_layers",
           "read_model_info", "start_capture"]

LAYER_CONVENTION = (
    "layer k = output of decoder layer k (0-based), before normalisation = HF "
    "outputs.hidden_states[k+1] (k = L-1: the last layer's output before the final norm); "
    "final = post-norm last hidden state = HF last_hidden_state"
)


@dataclass(frozen=True)
class ModelInfo:
    """What the dataset records about the target model."""

    path: str
    revision: str | None
    architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int

    def to_dict(self) -> dict:
        return asdict(self)


def read_model_info(path: str, revision: str | None = None) -> ModelInfo:
    """Read hidden size, depth and architecture from a local model directory's config.json.

    Multimodal configs (e.g. Kimi-K2.5) keep the language model's fields under ``text_config``.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise MissingPathError(
            f"no config.json in model directory {path!r}: pass a local directory with the model's "
            "config.json (download it first; hs_dataset never downloads models)"
        )
    with open(cfg_path) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    archs = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
    try:
        return ModelInfo(
            path=os.path.abspath(path),
            revision=revision,
            architecture=str(archs[0]),
            hidden_size=int(text["hidden_size"]),
            num_layers=int(text["num_hidden_layers"]),
            vocab_size=int(text["vocab_size"]),
        )
    except KeyError as e:
        raise ConfigError(f"{cfg_path}: missing field {e.args[0]!r} needed to size the dataset") from None


def check_layers(layers: Iterable[int], info: ModelInfo) -> tuple[int, ...]:
    """Validate configured layer ids against the model (see the module docstring)."""
    out = tuple(int(k) for k in layers)
    if not out:
        raise ConfigError("no layers configured: set layers, e.g. --set layers=[1,15,28]")
    if len(set(out)) != len(out):
        raise ConfigError(f"layers {list(out)} contain duplicates: list each layer once (--set layers=...)")
    if list(out) != sorted(out):
        raise ConfigError(f"layers {list(out)} must be in increasing order: --layers {','.join(map(str, sorted(out)))}")
    bad = [k for k in out if not 0 <= k <= info.num_layers - 1]
    if bad:
        raise ConfigError(
            f"layers {bad} out of range for {info.architecture} with {info.num_layers} decoder layers: "
            f"valid ids are 0..{info.num_layers - 1} (layer k = output of decoder layer k before the final "
            "norm; the post-norm final state is always stored as hidden_final): fix --layers"
        )
    return out


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
    encodings: tuple[str, ...]

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[BackendItem]: ...

    def versions(self) -> dict[str, str]: ...

    def close(self) -> None: ...


def start_capture(backend: CaptureBackend, samples: Iterable[TokenizedSample], storage_dtype: str) -> Iterator[BackendItem]:
    """``backend.capture(samples)``, asking for ``storage_dtype`` when the backend can deliver it."""
    if storage_dtype != "bfloat16" and storage_dtype in getattr(backend, "encodings", ("bfloat16",)):
        return backend.capture(samples, encoding=storage_dtype)  # type: ignore[call-arg]
    return backend.capture(samples)
