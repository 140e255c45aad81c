"""``hs-dataset verify TARGET``: a build or a published version (``org/name``, ``org/name@v1.0``) against its
``hs_dataset.json``: the bytes (checksums), and with ``--probe N`` / ``--stats`` what they hold."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hs_dataset.cli.hub import quiet_hub
from hs_dataset.cli.objects import store_verify
from hs_dataset.cli.options import add_progress_arg
from hs_dataset.cli.render import table
from hs_dataset.errors import HubAccessError, MissingPathError, RepoIdError
from hs_dataset.hub.names import check_repo_id, check_revision

__all__ = ["cmd_verify", "register", "split_target"]


def split_target(target: str, revision: str | None) -> tuple[str, str | None]:
    """``org/name@v1.0`` -> (``org/name``, ``v1.0``); a directory, or a target with ``--revision``, as given."""
    if revision is None and "@" in target and not Path(target).is_dir():
        name, _, rev = target.partition("@")
        return name, rev or None
    return target, revision


def _print_stats(report) -> None:
    st = report.scan.statistics if report.scan is not None and report.scan.statistics else None
    if st is None:
        return
    rows = [(c, f"{s['mean']:.4g}", f"{s['std']:.4g}", f"{s['absmax']:.4g}", f"{s['nan']:,}", f"{s['inf']:,}",
             f"{s['fp8_limit_share']:.2%}") for c, s in st["columns"].items()]
    print(f"stats:     {st['rows']:,} rows, {st['tokens']:,} tokens, loss mask on {st['mask_fraction']:.1%}; "
          f"duplicates: {st['duplicates']['same_ids']:,} (token ids), {st['duplicates']['same_ids_and_mask']:,} "
          "(ids and mask)")
    for line in table(("column", "mean", "std", "absmax", "NaN", "Inf", "at fp8 limit"), rows):
        print(line)


def cmd_verify(a: argparse.Namespace) -> int:
    from hs_dataset.hub.access import check_hub  # deferred: huggingface_hub
    from hs_dataset.hub.verify_remote import verify_repo  # deferred: huggingface_hub, torch, datasets
    from hs_dataset.integrity.verify import ProbeOptions, verify_build  # deferred: torch, datasets

    target, revision = split_target(a.target, a.revision)
    if "://" in target:  # object storage (s3://, gs://, any fsspec URL)
        return store_verify(a, target, revision)
    local = Path(target)
    probe = ProbeOptions(rows=a.probe, seed=a.seed, model=a.model, source=a.source, device=a.device)
    if local.is_dir() and revision is None:
        report = verify_build(target, quick=a.quick, probe=probe, stats=a.stats)
    else:  # the local checks first (a file, a bad repo id or revision), then the Hub
        if local.exists():
            raise MissingPathError(f"{target} is a file, not a build directory: check the path")
        if revision is None and target.strip("/").count("/") != 1:
            raise MissingPathError(f"{target}: no such build directory (and not a repo id, org/name): check the path")
        try:
            check_repo_id(target)
        except RepoIdError as e:
            if revision is not None:  # a repo id was meant
                raise
            raise MissingPathError(f"{target}: no such build directory, and not a repo id ({e})") from None
        if revision is not None:
            check_revision(revision)
        quiet_hub(a.no_progress)
        try:
            check_hub(need_token=False)
        except HubAccessError as e:
            if revision is not None:
                raise
            raise HubAccessError(f"{target}: no such build directory here; as a repo id: {e}") from None
        report = verify_repo(target, revision=revision, quick=a.quick, probe=probe, stats=a.stats)
    sample_stats = None
    if a.stats and report.ok and local.is_dir() and revision is None:  # per row, for derive (older versions too)
        from hs_dataset.integrity.teacher_stats import write_sample_stats  # deferred: torch

        try:
            sample_stats = str(write_sample_stats(target, model=a.model))
        except MissingPathError as e:  # the shards verified; only the model's lm_head is not here
            sample_stats = f"not written: {e}"
    if a.format == "json":
        print(json.dumps({"ok": report.ok, "where": report.where, "commit": report.commit, "shards": report.shards,
                          "rows": report.rows, "problems": [str(p) for p in report.problems], "repair": report.repair,
                          "probe": report.probe.to_record() if report.probe is not None else None,
                          "statistics": report.scan.statistics if report.scan is not None else None,
                          "sample_stats": sample_stats}, indent=1))
    else:
        print(report.message())
        _print_stats(report)
        if sample_stats:
            print(f"per-row teacher statistics: {sample_stats}")
    return 0 if report.ok else 1


def _rows(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a number of rows, 1 or more")
    return n


def register(sub, common: argparse.ArgumentParser) -> None:
    c = sub.add_parser("verify", parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="check every shard of a build, or of a published version, against its recorded size, "
                            "rows and content hash; --probe N re-runs N rows through the reference backend, --stats "
                            "recounts the statistics (exit 1 naming the rows and parts to rebuild)",
                       epilog="examples:\n  hs-dataset verify demo_out\n  hs-dataset verify demo_out --probe 64\n"
                              "  hs-dataset verify org/name@v1.0 --probe 64 --model /models/Kimi-K2.5\n"
                              "  hs-dataset verify demo_out --stats")
    c.add_argument("target", help="a build directory, or a dataset repo id (org/name, org/name@v1.0)")
    c.add_argument("--revision", help="with a repo id: the version to check (default: main)")
    c.add_argument("--quick", action="store_true", help="size, first/last MiB and rows only (a repo: the Hub's file "
                                                        "list and sizes, nothing downloaded)")
    c.add_argument("--probe", type=_rows, default=0, metavar="N",
                   help="re-run N random rows (seeded, their ids printed) through the transformers backend on this "
                        "machine's device and compare every stored state, the tokens and the loss mask; a local "
                        "build records the result in hs_dataset.json and its card (a repo: only the shards holding "
                        "the rows are downloaded)")
    c.add_argument("--seed", type=int, default=0, help="which rows --probe draws (default 0)")
    c.add_argument("--model", help="with --probe: the model directory (default: the path the build recorded)")
    c.add_argument("--source", help="with --probe: the source to retokenize (default: the one the build recorded)")
    c.add_argument("--device", help="with --probe: cpu, cuda, cuda:1... (default: cuda when there is one)")
    c.add_argument("--stats", action="store_true", help="recount the statistics from every stored row and name each "
                                                        "row with NaN/Inf, saturated fp8 or an unrecorded duplicate "
                                                        "(a repo: downloads the whole version); a build: also writes "
                                                        "sample_stats.parquet, the teacher's entropy per row (derive)")
    c.add_argument("--format", choices=("text", "json"), default="text", help="the outcome as text or JSON")
    add_progress_arg(c)
    c.set_defaults(fn=cmd_verify)
