"""The target model's fingerprint: cheap at Kimi-K2.5's size (~600 GB), and it changes when the weights do.

Hashing every weight byte would read the whole model at every build start; the fingerprint has two parts:

* **weights** (:func:`weights_fingerprint`): per weight file of the model directory (``*.safetensors``,
  ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``) its name, size, safetensors header (names, dtypes, shapes,
  offsets) and the xxh3 of :data:`SAMPLES` blocks of :data:`SAMPLE_BYTES` spread evenly over the file: a
  few MiB read for the whole model. Other weights copied over the same files (same shapes) change the
  sampled bytes; it is re-checked before every part is committed, so weights overwritten while a build runs
  stop it (a model loaded through ``mmap`` would serve the new bytes to the later parts);
* **probe** (:func:`probe_fingerprint`): the captured states of :data:`PROBE_IDS`, a fixed token sequence
  run through the backend's own ``capture`` when the build starts it: a change of the weights the samples
  miss (one layer fine-tuned) changes the states. Any backend path (a start-up self-check included) can call
  it; a backend that cannot capture an arbitrary sample (an import's file reader) gives None.

The build records both in ``.hs_build/build.json`` (a resume, a worker share and a merge whose fingerprint
differs are refused, naming both: :func:`hs_dataset.write.resume.check_resume`) and in ``hs_dataset.json``
(``model_fingerprint``).
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from hs_dataset.records import CaptureResult, TokenizedSample

__all__ = ["PROBE_IDS", "SAMPLES", "SAMPLE_BYTES", "WEIGHT_SUFFIXES", "describe", "probe_fingerprint", "probe_sample",
           "same_probe", "weights_fingerprint"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES = 8  # blocks per file: a copy of other weights differs in every block; 8 also see a partial overwrite
SAMPLE_BYTES = 1 << 16
# A fixed token sequence (ids below every real vocabulary's size once taken modulo it): the same input for
# every backend, no tokenizer involved.
PROBE_IDS = tuple((7 + 131 * i) for i in range(16))
# States of the same prompt on the same weights agree to bf16 rounding (GPU kernels need not be bit-exact
# across starts); other weights move them by far more.
PROBE_COSINE = 0.999


def _safetensors_header(f: Any, size: int) -> bytes:
    if size < 8:
        return b""
    f.seek(0)
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n) if 0 < n <= min(size - 8, 100 << 20) else b""


def weights_fingerprint(model_dir: str | os.PathLike) -> str:
    """The weights part of the fingerprint of a local model directory (``"none"``: it holds no weight file).

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


def probe_sample(vocab_size: int) -> TokenizedSample:
    """The fixed probe sample for a model of ``vocab_size`` tokens."""
    ids = np.asarray([i % max(1, vocab_size) for i in PROBE_IDS], dtype=np.int32)
    return TokenizedSample("hs_dataset-model-probe", ids, np.ones(len(ids), dtype=np.uint8))


def probe_fingerprint(backend: Any) -> dict[str, Any] | None:
    """The probe part of the fingerprint: :func:`probe_sample` captured through ``backend.capture`` (bf16).

    -> ``{"digest": "p:<hex>", "signature": [...]}``: the digest of the states' bytes and, per stored layer,
    the first 16 values of the last position (what :func:`same_probe` compares when the digests differ).
    None when the backend rejects the sample (an import's file reader captures no arbitrary sample).
    """
    items = list(backend.capture([probe_sample(int(backend.info.vocab_size))]))
    results = [r for r in items if isinstance(r, CaptureResult)]
    if not results:
        return None
    import torch  # deferred: the capture stage's library, needed only when a backend runs

    states = torch.cat([r.states.to(torch.bfloat16) for r in results], dim=1)
    digest = hashlib.sha256(states.view(torch.int16).numpy().tobytes()).hexdigest()[:24]
    signature = states[:, -1, :16].float().tolist()
    return {"digest": "p:" + digest, "signature": signature}


def same_probe(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two probe fingerprints come from the same weights (equal digests, or every layer's signature at
    cosine >= :data:`PROBE_COSINE`)."""
    if a.get("digest") == b.get("digest"):
        return True
    sa, sb = a.get("signature"), b.get("signature")
    if not (isinstance(sa, list) and isinstance(sb, list) and len(sa) == len(sb)):
        return False
    for x, y in zip(sa, sb):
        u, v = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if u.shape != v.shape:
            return False
        nu, nv = float(np.linalg.norm(u)), float(np.linalg.norm(v))
        if nu == 0 or nv == 0:
            if nu != nv:
                return False
            continue
        if float(u @ v) / (nu * nv) < PROBE_COSINE:
            return False
    return True


def describe(key: dict[str, Any]) -> str:
    """A key's fingerprint in one word: ``w:<hex>/p:<hex>`` (what a refusal names)."""
    probe = key.get("model_probe")
    return f"{key.get('model_weights', 'none')}/{probe.get('digest') if isinstance(probe, dict) else 'p:none'}"
