"""The target model as a build sees it (its sizes, from config.json; its weights' fingerprint), and the layer ids it
accepts.

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
:mod:`hs_dataset.capture.sglang.plugin`), and the GPU parity test pins both backends to this convention.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import xxhash

from hs_dataset.errors import ConfigError, MissingPathError

__all__ = ["LAYER_CONVENTION", "SAMPLES", "SAMPLE_BYTES", "WEIGHT_SUFFIXES", "ModelInfo", "check_layers",
           "read_model_info", "target_of", "weights_fingerprint"]


LAYER_CONVENTION = (
    "layer k = output of decoder layer k (0-based), before normalisation = HF "
    "outputs.hidden_states[k+1] (k = L-1: the last layer's output before the final norm); "
    "final = post-norm last hidden state = HF last_hidden_state"
)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES = 8  # blocks per file: a copy of other weights differs in every block; 8 also see a partial overwrite
SAMPLE_BYTES = 1 << 16


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
            "config.json (download it first; hs_dataset never downloads models)", path=cfg_path, field="model")
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


def target_of(model: str | ModelInfo, layers: Iterable[int], revision: str | None = None) -> tuple[ModelInfo, tuple[int, ...]]:
    """A backend's model and layers: ``model`` read from its directory and ``layers`` checked against it,
    or a :class:`ModelInfo` a build resolved already, whose ``layers`` were checked with it.

    Raises:
        MissingPathError, ConfigError: as :func:`read_model_info` and :func:`check_layers`.
    """
    if isinstance(model, ModelInfo):
        return model, tuple(int(k) for k in layers)
    info = read_model_info(model, revision)
    return info, check_layers(layers, info)


def _safetensors_header(f: Any, size: int) -> bytes:
    if size < 8:
        return b""
    f.seek(0)
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n) if 0 < n <= min(size - 8, 100 << 20) else b""


def weights_fingerprint(model_dir: str | os.PathLike) -> str:
    """The weights part of the model's fingerprint (the probe part: :mod:`hs_dataset.capture.fingerprint`) of a local
    model directory; ``"none"``: it holds no weight file.

    Hashing every weight byte would read the whole model (~600 GB at Kimi-K2.5's size) at every build start: per
    weight file it takes its name, size, safetensors header and the xxh3 of :data:`SAMPLES` blocks of
    :data:`SAMPLE_BYTES` spread over it, a few MiB for the whole model. Other weights copied over the same files
    (same shapes) change the sampled bytes.

    Raises:
        OSError: a weight file cannot be read.
    """
    h = hashlib.sha256()
    root = Path(model_dir)
    files = sorted(p for p in root.rglob("*") if p.name.endswith(WEIGHT_SUFFIXES) and p.is_file()) \
        if root.is_dir() else []
    if not files:
        return "none"
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.relative_to(root)}\0{size}\0".encode())
        with open(p, "rb") as f:
            if p.name.endswith(".safetensors"):
                h.update(_safetensors_header(f, size))
            for k in range(SAMPLES):
                f.seek(max(0, (size - SAMPLE_BYTES) * k // max(1, SAMPLES - 1)))
                h.update(xxhash.xxh3_64_digest(f.read(SAMPLE_BYTES)))
    return "w:" + h.hexdigest()[:24]
