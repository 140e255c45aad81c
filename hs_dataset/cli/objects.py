"""``push``, ``versions`` and ``verify`` with an object-storage URL (``s3://bucket/prefix``, any fsspec URL)
instead of a Hub repo id: :mod:`hs_dataset.hub.object_push` and :mod:`hs_dataset.hub.objects`."""

from __future__ import annotations

import argparse
import dataclasses
import json

from hs_dataset.cli.render import print_versions, size
from hs_dataset.errors import ConfigError

__all__ = ["push_to_store", "store_verify", "store_versions"]


def push_to_store(a: argparse.Namespace) -> int:
    """``hs-dataset push DIR URL --version V``."""
    from hs_dataset.hub.object_push import push_objects  # deferred: imports torch, datasets

    if a.force:
        print(f"--force: a version in a store never changes; push {a.dir} under a new version name")
        return 2
    r = push_objects(a.dir, a.repo_id, a.version)
    if a.format == "json":
        print(json.dumps(dataclasses.asdict(r), indent=1))
    elif r.already_there:
        print(f"{r.url} {r.version} is already there with exactly this build (id {r.id[:12]}): nothing uploaded")
    else:
        print(f"pushed {a.dir} as {r.url} {r.version} (id {r.id[:12]}): {len(r.uploaded)} files written, "
              f"{len(r.skipped)} already there")
    return 0


def store_versions(a: argparse.Namespace) -> int:
    """``hs-dataset versions URL``."""
    from hs_dataset.hub.objects import list_object_versions  # deferred: fsspec, huggingface_hub

    print_versions(a.repo_id, list_object_versions(a.repo_id), a.format, ("version", "id", "rows", "size", "pushed (UTC)"),
                   lambda v: (v.version, v.commit_sha[:12], "n/a" if v.samples is None else f"{v.samples:,}",
                              size(v.bytes) if v.bytes is not None else "n/a",
                              (v.pushed_at or "n/a").replace("T", " ")))
    return 0


def store_verify(a: argparse.Namespace, target: str, revision: str | None) -> int:
    """``hs-dataset verify URL [--revision V] [--quick]``."""
    from hs_dataset.hub.objects import verify_object_version  # deferred: fsspec, huggingface_hub

    if a.probe or a.stats:
        raise ConfigError(f"--probe and --stats read a local copy: download it (open_dataset({target!r}, revision=..., "
                          "local_dir=DIR)), then `hs-dataset verify DIR --probe N`", field="probe")
    report = verify_object_version(target, revision=revision, quick=a.quick)
    if a.format == "json":
        print(json.dumps({"ok": report.ok, "where": report.where, "commit": report.commit, "shards": report.shards,
                          "rows": report.rows, "problems": [str(p) for p in report.problems],
                          "repair": report.repair}, indent=1))
    else:
        print(report.message())
    return 0 if report.ok else 1
