"""hs_dataset: versioned Hugging Face datasets of LLM hidden states for EAGLE-3 drafter training.

The entry points, imported lazily (``import hs_dataset`` pulls in neither torch nor SGLang):

* :func:`build` (:mod:`hs_dataset.shard_writer`) and :class:`HiddenStatesConfig`: build or resume a dataset;
* :func:`push_dataset` / :func:`list_versions` (:mod:`hs_dataset.publish`, :mod:`hs_dataset.hub_versions`): publish versions to the Hub;
* :func:`open_dataset`, :func:`load_verified`, :func:`iter_torch`, :class:`DrafterCollator` (:mod:`hs_dataset.reader`):
  read for training;
* :func:`verify_build` / :func:`verify_repo` (:mod:`hs_dataset.verify`): check a build or a version against its checksums;
* :func:`export_dataset` (:func:`export_specforge`), :func:`import_dataset` (:mod:`hs_dataset.interop`): move data to
  and from SpecForge, speculators and ModelOpt;
* :func:`build_shard`, :func:`shard_parts` (:mod:`hs_dataset.scaleout`), :func:`merge_shards` (:mod:`hs_dataset.merge`),
  :func:`build_with_ray` (:mod:`hs_dataset.ray_build`): one version built by many workers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_EXPORTS = {
    "build": "shard_writer", "BuildSummary": "shard_writer", "HiddenStatesConfig": "config",
    "push_dataset": "publish", "list_versions": "hub_versions",
    "open_dataset": "reader", "iter_torch": "reader", "decode_row": "reader", "DrafterCollator": "reader",
    "load_verified": "reader", "verify_build": "verify", "verify_repo": "verify",
    "export_specforge": "interop", "export_dataset": "interop", "import_dataset": "interop",
    "build_shard": "scaleout", "shard_parts": "scaleout", "merge_shards": "merge", "build_with_ray": "ray_build",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'hs_dataset' has no attribute {name!r}")
