"""``hs-dataset plan SCRIPT`` (= ``build --dry-run``): what a build would read, write and cost, before
any GPU time: samples, tokens, a length histogram, rejects by reason, bytes on disk, a time estimate."""

from __future__ import annotations

import argparse

import numpy as np

from hs_dataset.write.shares import share_parts
from hs_dataset.cli.options import add_config_args, make_config
from hs_dataset.cli.render import duplicates_line, histogram, print_rejects, size, table
from hs_dataset.scale.launchers import worker_count

__all__ = ["cmd_plan", "duration", "register", "show_plan"]


def duration(seconds: float) -> str:
    """``1h 05m``, ``3m 12s``, ``12.3s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s"


def _rate_line(plan, given: float | None) -> tuple[float | None, str]:
    """The rate used for the estimate, and what it is."""
    from hs_dataset.write.plan import MEASURED_RATES, estimate_rate  # deferred: imports torch, datasets

    if given:
        return given, f"{given:,.0f} tok/s (given)"
    est = estimate_rate(plan.info)
    if est is None:
        known = "; ".join(f"{r.tokens_per_second:,.0f} tok/s for a {r.shape}" for r in MEASURED_RATES)
        return None, (f"no measured rate for hidden size {plan.info.hidden_size}; one H200 (SGLang 0.5.17) measured "
                      f"{known}. Pass --tok-per-s N (your engine's plain prefill) for an estimate")
    rate, ref = est
    scaled = "" if ref.num_layers == plan.info.num_layers else (
        f", scaled by depth {ref.num_layers} -> {plan.info.num_layers} layers (an estimate)")
    return rate, (f"{rate:,.0f} tok/s per engine: one {ref.gpu}'s measured plain prefill (SGLang 0.5.17) for a "
                  f"{ref.shape}{scaled}; pass --tok-per-s N for your own")


def show_plan(config, a: argparse.Namespace) -> int:
    """Print the plan of ``config`` (``a``: ``tok_per_s``, ``workers`` where the command has them)."""
    from hs_dataset.write.plan import plan_build  # deferred: imports torch, datasets

    p = plan_build(config)
    lengths = np.asarray(p.lengths, dtype=np.int64)
    states = ", ".join(map(str, p.layers)) + " + final"
    print(f"plan of {a.script} (nothing run: the model's config.json, the tokenizer and the source only)")
    print(f"model:    {p.info.architecture} ({p.info.path}), hidden {p.info.hidden_size}, {p.info.num_layers} "
          f"layers; captures {states} ({p.n_states} states), backend {config.backend}")
    limit = "all" if config.max_samples is None else f"{config.max_samples:,}"
    print(f"source:   {config.source}: {p.source_rows:,} rows; this build reads {p.rows:,} (max_samples: {limit}) "
          f"in {len(p.part_samples)} parts of {config.part_size}")
    print(f"samples:  {len(p.lengths):,} to write, {len(p.rejects):,} rejected; {p.truncated:,} cut to max_length "
          f"{config.max_length} (truncation={config.truncation})")
    if lengths.size:
        print(f"tokens:   {p.tokens:,} (per sample: min {lengths.min():,}, median {int(np.median(lengths)):,}, "
              f"mean {lengths.mean():,.0f}, max {lengths.max():,}); loss mask on {p.masked_tokens / p.tokens:.1%}")
        print("lengths (tokens: samples):")
        for line in histogram(lengths):
            print(line)
    print_rejects([r.to_dict() for r in p.rejects], p.rows)
    rate, what = _rate_line(p, getattr(a, "tok_per_s", None))
    d = p.duplicates
    print(duplicates_line(d.same_ids, d.same_rows, d.tokens, config.duplicates,
                          prefill=duration(d.tokens / rate) if rate and d.tokens else None))
    print("on disk (states + input_ids + loss_mask):")
    rows = [(d + (" (this build)" if d == config.storage_dtype else ""), f"{p.bytes_per_token(d):,} B/token",
             size(n)) for d, n in p.bytes_on_disk().items()]
    for line in table(("storage_dtype", "per token", "total"), rows):
        print(line)
    if rate:
        bpt = p.bytes_per_token(config.storage_dtype)
        print(f"time:     {duration(p.tokens / rate)} of prefill at {what}. At that rate the build writes "
              f"{size(rate * bpt)}/s to disk: a slower disk bounds it (README: GPU tests and benchmarks)")
    else:
        print(f"time:     {what}")
    for note in p.notes:
        print(f"note:     {note}")
    n = None if getattr(a, "workers", None) is None else worker_count(a.workers)
    if n:
        print(f"workers:  {n}; part p goes to worker share p % {n} (round-robin by part, as the build splits it)")
        shares: list[tuple] = []
        for k, parts in enumerate(share_parts(len(p.part_samples), n)):
            tokens = sum(p.part_tokens[i] for i in parts)
            shares.append((k, len(parts), f"{sum(p.part_samples[i] for i in parts):,}", f"{tokens:,}",
                         duration(tokens / rate) if rate else "n/a"))
        for line in table(("share", "parts", "samples", "tokens", "time"), shares):
            print(line)
    return 0


def cmd_plan(a: argparse.Namespace) -> int:
    return show_plan(make_config(a), a)


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            v = 0
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number")
        return v
    return parse


def register(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("plan", parents=[common],
                       help="before spending GPU hours: read and tokenize the source as the build would, print "
                            "samples, tokens, lengths, rejects, bytes on disk and a time estimate (no model run)")
    add_config_args(p)
    p.add_argument("--tok-per-s", type=_positive(float), metavar="N",
                   help="prefill tokens/s of your engine, for the time estimate (default: a measured H200 figure "
                        "for the model's shape, where there is one)")
    p.add_argument("--workers", metavar="N|auto", help="also print the split over N workers (auto: the launcher's "
                                                         "count, SLURM_ARRAY_TASK_COUNT or torchrun's WORLD_SIZE)")
    p.set_defaults(fn=cmd_plan)
