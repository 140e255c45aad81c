"""``hs-dataset plan SCRIPT`` (= ``build --dry-run``): what a build would read, write and cost, before
any GPU time: samples, tokens, a length histogram, rejects by reason, bytes on disk, a time estimate."""

from __future__ import annotations

import argparse

from hs_dataset.cli.options import ConfigHelp, add_config_args, add_progress_arg, make_config
from hs_dataset.cli.derive import print_tag_counts
from hs_dataset.cli.render import duplicates_line, histogram, print_rejects, size, table

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
    """Print the plan of ``config`` (``a``: ``tok_per_s``, ``workers``, ``sample``, ``no_progress`` where the
    command has them)."""
    import numpy as np  # deferred: the command line starts without numpy

    from hs_dataset.scale.launchers import worker_count  # deferred: imports pyarrow
    from hs_dataset.write.plan import plan_build  # deferred: imports torch, datasets
    from hs_dataset.write.shares import share_parts  # deferred: imports pyarrow

    sample = getattr(a, "sample", None)
    n = None if getattr(a, "workers", None) is None else worker_count(a.workers)  # a bad --workers: before the work
    p = plan_build(config, sample=sample, progress=not getattr(a, "no_progress", False))
    lengths = np.asarray(p.lengths, dtype=np.int64)
    states = ", ".join(map(str, p.layers)) + " + final"
    print(f"plan of {a.script} (nothing run: the model's config.json, the tokenizer and the source only)")
    print(f"model:    {p.info.architecture} ({p.info.path}), hidden {p.info.hidden_size}, {p.info.num_layers} "
          f"layers; captures {states} ({p.n_states} states), backend {config.backend}")
    limit = "all" if config.max_samples is None else f"{config.max_samples:,}"
    print(f"source:   {config.source}: {p.source_rows:,} rows; this build reads {p.rows:,} (max_samples: {limit}) "
          f"in {len(p.part_samples)} parts of {config.part_size}")
    est = ""
    if p.sampled:
        est = " in the sample"
        print(f"sample:   {p.sampled:,} of the {p.rows:,} rows tokenized (--sample {sample}: blocks spread over the "
              f"source); the build's totals below are estimates, x{p.scale:,.2f}")
    print(f"samples:  {len(p.lengths):,} to write, {len(p.rejects):,} rejected{est}; {p.truncated:,} cut to max_length "
          f"{config.max_length} (truncation={config.truncation})"
          + (f"; the build: ~{round(len(p.lengths) * p.scale):,} to write" if p.sampled else ""))
    if lengths.size:
        total = f"~{p.build_tokens:,} (estimated; {p.tokens:,} in the sample)" if p.sampled else f"{p.tokens:,}"
        print(f"tokens:   {total} (per sample: min {lengths.min():,}, median {int(np.median(lengths)):,}, "
              f"mean {lengths.mean():,.0f}, max {lengths.max():,}); loss mask on {p.masked_tokens / p.tokens:.1%}")
        print("lengths (tokens: samples):")
        for line in histogram(lengths):
            print(line)
    print_rejects([r.to_dict() for r in p.rejects], p.sampled or p.rows)
    print("on disk (states + input_ids + loss_mask, as Arrow shards; compression=zstd or parquet codes them "
          "losslessly, smaller by what the states compress to)" + (", estimated:" if p.sampled else ":"))
    from hs_dataset.codec.sizes import storage_options  # deferred: imports nothing heavy, kept beside plan_costs

    this = config.storage_dtype + (f" + teacher {config.teacher}" if config.teacher else "") + \
        ("" if config.store_final else ", store_final=false")
    rows = [(d + (" (this build)" if d == this else ""), f"{b:,.0f} B/token", size(p.build_tokens * b))
            for d, b in storage_options(p.n_states, p.info.hidden_size,
                                        masked_fraction=p.masked_tokens / max(p.tokens, 1))]
    for line in table(("storage_dtype", "per token", "total"), rows):
        print(line)
    from hs_dataset.write.shard_sizing import sizing_rows  # deferred: beside the other plan stages

    data = int(p.build_tokens * p.bytes_per_token(config.storage_dtype))
    shard = min(config.max_shard_bytes, data // max(len(p.part_samples), 1))  # a part's rows in shards of at most that
    print(f"many nodes (open_ranked: each rank fetches its shards; this build's shards ~{size(shard)}):")
    for line in table(("ranks", "fetched per epoch", "largest shard for <= 5%", "cache per 8-rank node"),
                      sizing_rows(data, max(shard, 1))):
        print(line)
    from hs_dataset.write.plan_costs import memory_lines, prefill_seconds  # deferred: imports torch, datasets

    for line in memory_lines(p):
        print(line)
    rate, what = _rate_line(p, getattr(a, "tok_per_s", None))
    d = p.duplicates
    print(duplicates_line(d.same_ids, d.same_rows, d.tokens, config.duplicates,
                          prefill=duration(d.tokens / rate) if rate and d.tokens else None))
    if rate:
        bpt = p.bytes_per_token(config.storage_dtype)
        by_length: list[str] = []
        if getattr(a, "tok_per_s", None):
            seconds = p.build_tokens / rate
        else:
            seconds, by_length = prefill_seconds(p, rate)
            seconds *= p.scale  # a sample's lengths stand for the whole source
        longer = f" (by sample length: {'; '.join(by_length)})" if len(by_length) > 1 else ""
        print(f"time:     {duration(seconds)} of prefill at {what}{longer}. At that rate the build writes "
              f"{size(rate * bpt)}/s to disk: a slower disk bounds it (docs/benchmarks.md)")
    else:
        print(f"time:     {what}")
    print_tag_counts(p.tag_counts, p.sampled or len(p.lengths) or 1, " of the rows tokenized" if p.sampled else "")
    for note in p.notes:
        print(f"note:     {note}")
    if n:
        print(f"workers:  {n}; part p goes to worker share p % {n} (round-robin by part, as the build splits it)"
              + ("; a share's samples and tokens: its rows' part of the estimate" if p.sampled else ""))
        shares: list[tuple] = []
        for k, parts in enumerate(share_parts(len(p.part_samples), n)):
            if p.sampled:  # the sample does not cover every part: a share's part of the estimate, by its rows
                share_rows = sum(min(config.part_size, p.rows - i * config.part_size) for i in parts)
                samples, tokens = (round(x * share_rows / max(p.rows, 1) * p.scale) for x in (len(p.lengths), p.tokens))
            else:
                samples, tokens = sum(p.part_samples[i] for i in parts), sum(p.part_tokens[i] for i in parts)
            shares.append((k, len(parts), f"{samples:,}", f"{tokens:,}", duration(tokens / rate) if rate else "n/a"))
        for line in table(("share", "parts", "samples", "tokens", "time"), shares):
            print(line)
    if not len(p.lengths):  # what the build would stop with (EmptyBuildError): exit 2 like it
        from hs_dataset.errors import EmptyBuildError  # deferred: as the other imports of this command

        why = (f"all {len(p.rejects):,} samples{est} would be rejected (the rejects above say why)" if p.rejects
               else f"the source {config.source} has no rows (max_samples: {limit})")
        raise EmptyBuildError(f"{a.script}: no sample would be written: {why}; the build would stop. Fix the source "
                              "or the configuration")
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
    p = sub.add_parser("plan", parents=[common], add_help=False,
                       help="before spending GPU hours: read and tokenize the source as the build would, print "
                            "samples, tokens, lengths, rejects, bytes on disk and a time estimate (no model run)",
                       description="Read and tokenize the source as the build would (no model run) and print what "
                                   "it would write and cost.")
    p.add_argument("-h", "--help", action=ConfigHelp, help="show this help, every config field and backend option")
    add_config_args(p)
    p.add_argument("--sample", type=_positive(int), metavar="N",
                   help="tokenize only about N rows (in blocks spread over the source) and scale the counts up: "
                        "an estimate in seconds instead of the exact plan")
    add_progress_arg(p)
    p.add_argument("--tok-per-s", type=_positive(float), metavar="N",
                   help="prefill tokens/s of your engine, for the time estimate (default: a measured H200 figure "
                        "for the model's shape, where there is one)")
    p.add_argument("--workers", metavar="N|auto", help="also print the split over N workers (auto: the launcher's "
                                                         "count, SLURM_ARRAY_TASK_COUNT or torchrun's WORLD_SIZE)")
    p.set_defaults(fn=cmd_plan)
