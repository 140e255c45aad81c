"""The target model's fingerprint: cheap at Kimi-K2.5's size (~600 GB), and it changes when the weights do.

Hashing every weight byte would read the whole model at every build start; the fingerprint has two parts:

* **weights** (:func:`hs_dataset.model_info.weights_fingerprint`, read with the model's ``config.json`` when a
  build is resolved): its weight files' names, sizes, safetensors headers and sampled bytes; it is re-checked
  before every part is committed, so weights overwritten while a build runs stop it;
* **probe** (:func:`probe_fingerprint`): the captured states of :data:`PROBE_IDS`, a fixed token sequence
  run through the backend's own ``capture`` when the build starts it: a change of the weights the samples
  miss (one layer fine-tuned) changes the states. Any backend path (a start-up self-check included) can call
  it; a backend that cannot capture an arbitrary sample (an import's file reader) gives None.

The build records both in ``.hs_build/build.json`` (a resume, a worker share and a merge whose fingerprint
differs are refused, naming both: :func:`hs_dataset.write.build_key.check_resume`) and in ``hs_dataset.json``
(``model_fingerprint``).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from hs_dataset.records import CaptureResult, TokenizedSample

__all__ = ["PROBE_IDS", "describe", "probe_fingerprint", "probe_sample", "same_probe"]

# A fixed token sequence (ids below every real vocabulary's size once taken modulo it): the same input for
# every backend, no tokenizer involved.
PROBE_IDS = tuple((7 + 131 * i) for i in range(16))
# States of the same prompt on the same weights agree to bf16 rounding (GPU kernels need not be bit-exact
# across starts); other weights move them by far more.
PROBE_COSINE = 0.999


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
