"""``hs-dataset push`` and ``versions``: the Hub checked before any work, readable summaries."""

from __future__ import annotations

import argparse
import dataclasses
import json

from hs_dataset.write.progress import is_terminal
from hs_dataset.cli.options import add_progress_arg
from hs_dataset.cli.objects import push_to_store, store_versions
from hs_dataset.cli.render import print_versions, size
from hs_dataset.hub.names import check_repo_id, check_version_name

__all__ = ["cmd_push", "cmd_versions", "dash_version", "push", "quiet_hub", "register"]


def dash_version(argv: list[str]) -> list[str]:
    """``argv`` with ``--version -v1`` written ``--version=-v1``, so that a version name starting with '-' meets
    its rule (:mod:`hs_dataset.hub.names`, one line) instead of argparse's usage error.

    Only after the command (``hs-dataset --version`` takes no value) and before ``--``; a next word that
    reads as an option (``--...``, or ``-x`` of two characters) is left to argparse.
    """
    out: list[str] = []
    command = False
    i = 0
    while i < len(argv):
        word, after = argv[i], argv[i + 1] if i + 1 < len(argv) else ""
        if word == "--":
            return out + argv[i:]
        if command and word == "--version" and after.startswith("-") and not after.startswith("--") \
                and len(after) > 2:
            out.append(f"--version={after}")
            i += 2
            continue
        command = command or not word.startswith("-")
        out.append(word)
        i += 1
    return out


def quiet_hub(no_progress: bool) -> None:
    """huggingface_hub's upload/download bars: off with --no-progress or without a terminal (a log)."""
    from huggingface_hub.utils import disable_progress_bars  # deferred: huggingface_hub

    if no_progress or not is_terminal():
        disable_progress_bars()


def push(build_dir: str, repo_id: str, version: str, *, force: bool, as_json: bool = False) -> None:
    """Check what can be checked here (the version name, the repo id, the build), then the Hub (token,
    endpoint), push, print the outcome in a few lines (or JSON)."""
    from hs_dataset.hub.access import check_hub, endpoint_of, require_token  # deferred: huggingface_hub
    from hs_dataset.hub.publish import push_dataset  # deferred: imports torch, datasets
    from hs_dataset.hub.uploads import read_build  # deferred: imports huggingface_hub

    check_version_name(version)  # first: the name's rule, before the token or the build is looked at
    check_repo_id(repo_id)
    require_token()
    read_build(build_dir)  # a finished build here, before the network is asked anything
    user = check_hub(need_token=True)
    r = push_dataset(build_dir, repo_id, version, force=force)  # Hub failures: HubAccessError, printed by main
    if as_json:
        print(json.dumps(dataclasses.asdict(r), indent=1))
        return
    if r.already_there:
        done = "" if not r.resumed else "; finished the interrupted push (main: " + (
            "now this version" if r.main_updated else "left alone, a newer version is there") + ")"
        print(f"{repo_id} {r.version} is already there with exactly this build (tag at commit {r.commit_sha[:12]}) "
              f"on {endpoint_of()}: nothing uploaded{done}")
        return
    how = "force-pushed" if r.forced else "pushed"
    print(f"{how} {build_dir} as {repo_id} {r.version} (tag at commit {r.commit_sha[:12]}) to {endpoint_of()}"
          + (f" as {user}" if user else ""))
    print(f"  files: {len(r.uploaded)} uploaded, {len(r.skipped)} already there, {len(r.deleted)} of an older version "
          f"removed; {len(r.commits)} commits" + ("; resumed an interrupted push" if r.resumed else ""))
    if r.forced and r.previous_commit:
        print(f"  replaced commit {r.previous_commit[:12]} (recorded in the card)")
    print(f"  main: {'now this version' if r.main_updated else 'left alone (a newer version is there)'}")
    print(f'  open: open_dataset("{repo_id}", revision="{r.version}")  (hs_dataset.read: every shard checked, one '
          'copy on disk)')
    print(f'  load: load_dataset("{repo_id}", revision="{r.version}")  (plain datasets: no shard hash checked, two '
          'more copies; docs/datasets-compat.md)')


def cmd_push(a: argparse.Namespace) -> int:
    if "://" in a.repo_id:  # object storage (s3://, gs://, any fsspec URL)
        return push_to_store(a)
    quiet_hub(a.no_progress)
    push(a.dir, a.repo_id, a.version, force=a.force, as_json=a.format == "json")
    return 0


def cmd_versions(a: argparse.Namespace) -> int:
    from hs_dataset.hub.access import check_hub  # deferred: huggingface_hub
    from hs_dataset.hub.versions import list_versions  # deferred: imports torch, datasets

    if "://" in a.repo_id:  # object storage (s3://, gs://, any fsspec URL)
        return store_versions(a)
    check_repo_id(a.repo_id)
    check_hub(need_token=False)
    print_versions(a.repo_id, list_versions(a.repo_id), a.format,
                   ("version", "commit", "rows", "tokens", "rejected", "size", "pushed (UTC)"),
                   lambda v: (v.version, v.commit_sha[:12], _num(v.samples), _num(v.tokens), _num(v.rejected),
                              size(v.bytes) if v.bytes is not None else "n/a",
                              (v.pushed_at or "n/a").replace("T", " ")))
    return 0


def _num(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,}"


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("push", parents=[common], help="upload a built dataset to the Hub as a tagged version")
    p.add_argument("dir", help="the output directory of a finished build (hs-dataset build ... -o DIR)")
    p.add_argument("repo_id", help="the dataset repo on the Hub, org/name (made if it does not exist)")
    p.add_argument("--version", required=True, help="the version's tag, e.g. v1.0")
    p.add_argument("--force", action="store_true", help="replace an existing version (recorded in the card)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="the summary as text or JSON")
    add_progress_arg(p)
    p.set_defaults(fn=cmd_push)
    v = sub.add_parser("versions", parents=[common], help="list the versions of a dataset repo with their counts")
    v.add_argument("repo_id", help="the dataset repo on the Hub, org/name")
    v.add_argument("--format", choices=("text", "json"), default="text", help="a table, or JSON")
    v.set_defaults(fn=cmd_versions)
