"""hs_dataset: versioned Hugging Face datasets of LLM hidden states for EAGLE-3 drafter training.

The package reads as the pipeline: ``prepare`` (sources, chat template, loss mask) -> ``capture``
(backends, the SGLang plugin, the ring) -> ``codec`` -> ``write`` (parts, resume, the final step) ->
``integrity`` -> ``hub`` -> ``read``, with ``scale`` (many workers), ``interop``, ``cli`` and ``demo``
beside it. The entry points, imported lazily (``import hs_dataset`` pulls in neither torch nor SGLang):

* :func:`build` and :class:`HiddenStatesConfig`: build or resume a dataset;
* :func:`push_dataset` / :func:`list_versions`: publish versions to the Hub, list them;
* :func:`open_dataset` (a local build or a published version), :func:`iter_torch`, :func:`decode_row`,
  :class:`DrafterCollator`: read for training;
* :func:`verify_build` / :func:`verify_repo`: check a build or a version against its checksums, and what its
  rows hold (``probe=ProbeOptions(rows=64)``: rows re-run through the reference backend; ``stats=True``);
* :func:`export_dataset` (:func:`export_specforge`), :func:`import_dataset`: move data to and from
  SpecForge, speculators and ModelOpt;
* :func:`build_share`, :func:`share_parts`, :func:`merge_shares`, :func:`build_with_ray`: one version
  built by many workers (``build_shard``, ``shard_parts`` and ``merge_shards``, their names before 0.3,
  still work and warn);
* :func:`open_stream` and :class:`StreamPublisher`: train while it builds (``stream``);
* :func:`open_ranked` and :func:`push_objects`: train on many nodes from one version, on the Hub or in object
  storage (``s3://``, any fsspec URL).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from hs_dataset._version import __version__

_EXPORTS = {
    "build": "hs_dataset.write.driver", "BuildSummary": "hs_dataset.write.driver",
    "HiddenStatesConfig": "hs_dataset.config",
    "push_dataset": "hs_dataset.hub.publish", "list_versions": "hs_dataset.hub.versions",
    "open_dataset": "hs_dataset.read.open",
    "iter_torch": "hs_dataset.read.iterate", "decode_row": "hs_dataset.read.decode",
    "DrafterCollator": "hs_dataset.read.collate",
    "verify_build": "hs_dataset.integrity.verify", "verify_repo": "hs_dataset.hub.verify_remote",
    "ProbeOptions": "hs_dataset.integrity.verify",
    "export_specforge": "hs_dataset.interop", "export_dataset": "hs_dataset.interop",
    "import_dataset": "hs_dataset.interop",
    "build_share": "hs_dataset.scale.worker", "share_parts": "hs_dataset.write.shares",
    "merge_shares": "hs_dataset.scale.merge", "build_with_ray": "hs_dataset.scale.ray",
    "open_stream": "hs_dataset.stream.dataset", "StreamPublisher": "hs_dataset.stream.publish",
    "open_ranked": "hs_dataset.read.ranked", "push_objects": "hs_dataset.hub.object_push",
}
# Names of 0.2, kept working (with a FutureWarning): a worker's share of a build was called a shard.
_RENAMED = {"build_shard": "build_share", "shard_parts": "share_parts", "merge_shards": "merge_shares"}

__all__ = [
    "BuildSummary", "DrafterCollator", "HiddenStatesConfig", "ProbeOptions", "StreamPublisher", "__version__", "build",
    "build_share", "build_with_ray", "decode_row", "export_dataset", "export_specforge", "import_dataset", "iter_torch",
    "list_versions", "merge_shares", "open_dataset", "open_ranked", "open_stream", "push_dataset", "push_objects",
    "share_parts", "verify_build", "verify_repo",
]

if TYPE_CHECKING:  # what the lazy __getattr__ below gives, for type checkers and IDEs
    from hs_dataset.write.driver import BuildSummary, build
    from hs_dataset.write.shares import share_parts
    from hs_dataset.config import HiddenStatesConfig
    from hs_dataset.hub.object_push import push_objects
    from hs_dataset.hub.publish import push_dataset
    from hs_dataset.hub.versions import list_versions
    from hs_dataset.hub.verify_remote import verify_repo
    from hs_dataset.integrity.verify import ProbeOptions, verify_build
    from hs_dataset.interop import export_dataset, export_specforge, import_dataset
    from hs_dataset.read.collate import DrafterCollator
    from hs_dataset.read.decode import decode_row
    from hs_dataset.read.iterate import iter_torch
    from hs_dataset.read.open import open_dataset
    from hs_dataset.read.ranked import open_ranked
    from hs_dataset.scale.merge import merge_shares
    from hs_dataset.scale.ray import build_with_ray
    from hs_dataset.scale.worker import build_share
    from hs_dataset.stream.dataset import open_stream
    from hs_dataset.stream.publish import StreamPublisher


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        warnings.warn(f"hs_dataset.{name} is now hs_dataset.{_RENAMED[name]} (a worker's part of a build is a "
                      "'share'; a 'shard' is a data file)", FutureWarning, stacklevel=2)
        name = _RENAMED[name]
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hs_dataset' has no attribute {name!r}")
