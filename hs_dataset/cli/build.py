"""``hs-dataset build``: build (or resume) a dataset from a builder script; ``--dry-run`` plans it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hs_dataset.write.rejects import read_rejects
from hs_dataset.cli.hub import push, quiet_hub
from hs_dataset.cli.options import ConfigHelp, add_config_args, add_progress_arg, command_line, make_config
from hs_dataset.cli.plan import duration, show_plan
from hs_dataset.cli.render import duplicates_line, print_rejects, size
from hs_dataset.cli.scale import add_build_args, scaleout_build, wants_scaleout
from hs_dataset.cli.stream import add_stream_args, stream_sink
from hs_dataset.errors import ConfigError, EmptyBuildError, RejectRateError
from hs_dataset.hub.names import check_repo_id, check_version_name
from hs_dataset.layout import DUPLICATE_STAGE, META_FILE, REJECTS_FILE

__all__ = ["DEFAULT_MAX_REJECT_RATE", "add_reject_rate_arg", "cmd_build", "print_duplicates", "register"]

# More than 1 in 10 rows rejected is nearly always a mistake (the source's schema, the chat template,
# max_length with truncation=reject), not data worth publishing; docs/building/resume.md says why.
DEFAULT_MAX_REJECT_RATE = 0.10


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction of the samples, 0 to 1 (e.g. 0.25)")
    return v


def add_reject_rate_arg(p: argparse.ArgumentParser, what: str, note: str) -> None:
    """``--max-reject-rate FRACTION`` (build and import): exit 2 when more of the ``what`` than that."""
    p.add_argument("--max-reject-rate", type=_rate, default=DEFAULT_MAX_REJECT_RATE, metavar="FRACTION",
                   help=f"exit 2 with the reject breakdown when more of the {what} (default "
                        f"{DEFAULT_MAX_REJECT_RATE:g}; {note})")


def print_duplicates(out: str) -> None:
    """The build's duplicate prompts (``hs_dataset.json``'s ``statistics.duplicates``) and their prefill cost."""
    from hs_dataset.write.plan import rate_for  # deferred: imports torch, datasets

    try:
        meta = json.loads((Path(out) / META_FILE).read_text(encoding="utf-8"))
        d = meta["statistics"]["duplicates"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no statistics (a share's build, an older part)
    model = meta.get("model") or {}
    rate = rate_for(int(model.get("hidden_size", 0)), int(model.get("num_layers", 1)))
    prefill = f"~{duration(d['tokens'] / rate[0])} at one H200's measured rate" if rate and d["tokens"] else None
    print(duplicates_line(int(d["same_ids"]), int(d["same_ids_and_mask"]), int(d["tokens"]), str(d["policy"]),
                          skipped=int(d.get("skipped", 0)), prefill=prefill, written=True))


def cmd_build(a: argparse.Namespace) -> int:
    config = make_config(a)  # every error of the configuration itself, before anything heavy is imported
    if a.dry_run:
        return show_plan(config, a)
    if a.push:
        if not a.version:
            raise ConfigError("--push needs --version, e.g. --push org/name --version v1.0")
        check_version_name(a.version)  # the local checks first, then the Hub
        check_repo_id(a.push)
        from hs_dataset.hub.access import check_hub  # deferred: huggingface_hub

        check_hub(need_token=True)  # before the build, not after its GPU hours
    sink = stream_sink(a, wants_scaleout(a))  # --stream: trainers read the rows as they are made (cli/stream.py)
    from hs_dataset.write.driver import build  # deferred: imports torch, datasets

    if wants_scaleout(a):  # --workers / --worker-index / --ray: one worker of many (cli/scale.py)
        merged = scaleout_build(a, config, command_line())
        if merged is None:  # this worker's share is built; the worker of the last one merges (and pushes)
            return 0
        c = merged.counts
        print_duplicates(a.output)  # the summary's line comes last: a user reads the end of the output
        print(merged.message())
    else:
        try:
            s = build(config, a.output, progress=not a.no_progress, build_command=command_line(),
                      allow_shrink=a.allow_shrink, sink=sink)
        except EmptyBuildError:
            rejects = read_rejects(a.output)
            if rejects:
                print_rejects(rejects, len(rejects), file=sys.stderr)
            raise
        c = s.counts
        print_duplicates(a.output)
        print(f"built {s.output_dir}: {c.written:,} samples written, {c.rejected:,} rejected (of {c.samples_in:,}), "
              f"{c.tokens_written:,} tokens, {size(s.bytes_written)} in {s.seconds:.1f}s "
              f"({s.parts_built} parts built, {s.parts_skipped} already done)")
    if c.rejected:  # the same check for a single worker's build and a merged one
        rejects = read_rejects(a.output)
        bad = c.rejected - c.rejects_by_stage.get(DUPLICATE_STAGE, 0)  # duplicates=skip leaves those out on purpose
        too_many = bad > a.max_reject_rate * c.samples_in
        print_rejects(rejects, c.samples_in, most=8 if too_many else 3, file=sys.stderr if too_many else sys.stdout)
        if too_many:
            raise RejectRateError(
                f"{bad} of {c.samples_in} samples rejected ({bad / c.samples_in:.0%}), more than "
                f"--max-reject-rate {a.max_reject_rate:g}: the build in {a.output} is kept (finished; "
                f"{REJECTS_FILE} lists every reject){'; nothing was pushed' if a.push else ''}. Fix the source or "
                f"the config (see the reasons above), or accept it: the same command with --max-reject-rate "
                f"{min(1.0, round(bad / c.samples_in + 0.005, 2)):g}")
        print(f"every reject with its reason: {Path(a.output) / REJECTS_FILE}")
    if a.push:
        quiet_hub(a.no_progress)  # huggingface_hub's upload bar follows --no-progress, as push's does
        push(a.output, a.push, a.version, force=a.force)
    return 0


def register(sub, common: argparse.ArgumentParser) -> None:
    b = sub.add_parser("build", parents=[common], add_help=False,
                       help="build (or resume) a dataset from a builder script (--help lists every config field)",
                       description="Build (or resume: run the same command again) a dataset from a builder script.")
    b.add_argument("-h", "--help", action=ConfigHelp, help="show this help, every config field and backend option")
    add_config_args(b)
    b.add_argument("--output", "-o", required=True, help="output directory (resumable)")
    b.add_argument("--dry-run", action="store_true",
                   help="read and tokenize the source, print the plan (samples, tokens, bytes, time); no model run "
                        "(= hs-dataset plan)")
    add_reject_rate_arg(b, "samples are rejected", "a build with no sample written always fails")
    b.add_argument("--allow-shrink", action="store_true",
                   help="with a max_samples below the rows the output already holds: delete the rows beyond it "
                        "(refused otherwise)")
    add_progress_arg(b)
    b.add_argument("--push", metavar="ORG/NAME", help="push to the Hub when the build is done (the token and "
                                                      "endpoint are checked first)")
    b.add_argument("--version", help="version tag for --push, e.g. v1.0")
    b.add_argument("--force", action="store_true", help="with --push: replace an existing version")
    add_build_args(b)
    add_stream_args(b)
    b.set_defaults(fn=cmd_build)
