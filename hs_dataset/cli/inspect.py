"""``hs-dataset inspect DIR``: what a build holds, with statistics of its states, lengths, loss mask,
rejects and shard verification; ``--plot FILE.png`` draws them; ``--schema`` adds the Arrow schema."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hs_dataset.write.rejects import read_rejects
from hs_dataset.cli.render import duplicates_line, histogram, print_rejects, size, table
from hs_dataset.errors import NotABuildError
from hs_dataset.layout import DATA_DIR, META_FILE

__all__ = ["cmd_inspect", "register"]


def cmd_inspect(a: argparse.Namespace) -> int:
    import numpy as np  # deferred: the command line starts without numpy
    from hs_dataset.integrity.verify import verify_build  # deferred: imports torch, datasets
    from hs_dataset.read.stats import build_stats, plot_stats  # deferred: imports torch, datasets

    out = Path(a.dir)
    if not (out / META_FILE).exists():
        if not out.exists():
            raise NotABuildError(f"{out}: no such directory: check the path")
        raise NotABuildError(f"{out} is not a finished hs_dataset build (no {META_FILE}): run its build command "
                             "(again) to finish it")
    meta = json.loads((out / META_FILE).read_text(encoding="utf-8"))
    m, c = meta["model"], meta["counts"]
    print(f"dataset:   {out}")
    print(f"model:     {m['architecture']} ({m['path']}), hidden {m['hidden_size']}, {m['num_layers']} layers")
    print(f"layers:    {meta['layers']} + final   ({meta['layer_convention']})")
    print(f"dtype:     {meta['storage_dtype']} stored as {meta['stored_as']}")
    print(f"samples:   {c['written']:,} written, {c['rejected']:,} rejected, {c['samples_in']:,} in; "
          f"{c['tokens_written']:,} tokens")
    per_token = f"; {meta['bytes'] / c['tokens_written']:,.1f} bytes/token" if c["tokens_written"] else ""
    print(f"files:     {meta.get('files', len(meta.get('shards', [])))} shards, {size(meta['bytes'])}{per_token}")
    print(f"backend:   {meta['backend']['name']} {meta['backend'].get('versions', {})}")
    report = verify_build(out, quick=True)
    print(f"verify:    {report.message()}")
    print_rejects(read_rejects(out), c["samples_in"])
    if report.ok and c["written"]:
        stats = build_stats(out, sample_rows=a.sample_rows)
        print(f"lengths:   min {stats.lengths.min():,}, median {int(np.median(stats.lengths)):,}, mean "
              f"{stats.lengths.mean():,.0f}, max {stats.lengths.max():,} tokens (max_length {meta['max_length']})")
        for line in histogram(stats.lengths):
            print(line)
        print(f"loss mask: {stats.mask_coverage:.1%} of tokens ({stats.masked_tokens:,} of {stats.tokens:,})")
        n_tok = int(sum(stats.lengths[i] for i in stats.sampled_rows))
        norms = {s.column: f"{float(np.mean(s.token_norms)):.4g}" for s in stats.states}
        recorded = meta.get("statistics")
        if recorded:
            print(f"states:    every value, counted while the build wrote it ({meta['storage_dtype']}); mean token "
                  f"norm over {len(stats.sampled_rows)} sampled rows ({n_tok:,} tokens):")
            rows: list[tuple[str, ...]] = [
                (c, f"{s['mean']:.4g}", f"{s['std']:.4g}", f"{s['absmax']:.4g}", f"{s['nan']:,}", f"{s['inf']:,}",
                 f"{s['fp8_limit_share']:.2%}", norms.get(c, "n/a")) for c, s in recorded["columns"].items()]
            head: tuple[str, ...] = ("column", "mean", "std", "absmax", "NaN", "Inf", "at fp8 limit", "mean token norm")
        else:
            print(f"states:    {len(stats.sampled_rows)} of {stats.rows:,} rows sampled ({n_tok:,} tokens), as bf16 "
                  "(this build records no statistics):")
            rows = [(s.column, f"{s.mean:.4g}", f"{s.std:.4g}", f"{s.absmax:.4g}", f"{s.nonfinite:,}", norms[s.column])
                    for s in stats.states]
            head = ("column", "mean", "std", "absmax", "non-finite", "mean token norm")
        for line in table(head, rows):
            print(line)
        _print_quality(meta)
        _print_tags(out, meta, c["written"])
        if a.layers:
            _print_layers(out, a.sample_rows)
        if a.plot:
            print(f"plot:      {plot_stats(stats, a.plot, title=str(out))}")
    elif a.plot:
        print("plot:      not drawn (the shards do not match the metadata: run hs-dataset verify)")
    if a.schema:
        _print_schema(out)
    return 0 if report.ok else 1


def _print_quality(meta: dict) -> None:
    """The recorded flags, duplicates and probe (``hs_dataset.json``)."""
    st = meta.get("statistics") or {}
    if st:
        d = st["duplicates"]
        print(duplicates_line(int(d["same_ids"]), int(d["same_ids_and_mask"]), int(d["tokens"]), str(d["policy"]),
                              skipped=int(d.get("skipped", 0)), written=True))
        flags = st.get("flags") or []
        print(f"flagged:   {st.get('flagged', len(flags))} rows" + "".join(
            f"\n  row {f['row']} ({f['id']}): {f['column']} holds {f['what']}" for f in flags[:8]))
    p = meta.get("probe")
    if not p:
        print("probe:     not run (hs-dataset verify DIR --probe 64 re-runs 64 rows through the reference backend)")
    else:
        outcome = "every row matches" if p["ok"] else f"{len(p['failed'])} rows do not match (hs-dataset verify names them)"
        print(f"probe:     {p['rows']} rows (seed {p['seed']}) on {p['device']} at {p['at']}: {outcome}")


def _print_tags(out: Path, meta: dict, rows: int) -> None:
    """Rows by tag value (builds with tag columns: hs_dataset.prepare.tags)."""
    from hs_dataset.cli.derive import print_tag_counts  # deferred: pyarrow, torch
    from hs_dataset.integrity.build_rows import plain_columns  # deferred: pyarrow
    from hs_dataset.prepare.tags import count_tags  # deferred: pyarrow

    tags = plain_columns(out, meta)
    names = [c for c in tags.column_names if c.startswith("tag_")]
    counts: dict[str, dict] = {}
    for row in tags.select(names).to_pylist() if names else []:
        count_tags(counts, row)
    print_tag_counts(counts, rows)


def _print_layers(out: Path, rows: int) -> None:
    """The layer pilot view (hs_dataset.derive.layer_pilot): per captured layer, norm and similarities."""
    from hs_dataset.derive.layer_pilot import layer_pilot  # deferred: torch

    stats = layer_pilot(out, rows=rows)
    print(f"layers:    per captured layer, over the masked positions of {rows} sampled rows (pick aux layers: "
          "docs/choosing-data.md)")
    cells = [(s.layer, f"{s.norm:.4g}", "n/a" if s.cos_final is None else f"{s.cos_final:.3f}",
              "" if s.cos_prev is None else f"{s.cos_prev:.3f}") for s in stats]
    for line in table(("layer", "mean norm", "cos to final", "cos to previous"), cells):
        print(line)


def _print_schema(out: Path) -> None:
    import pyarrow as pa  # deferred: the command line starts without pyarrow
    import pyarrow.parquet as pq  # deferred: the command line starts without pyarrow

    files = sorted((out / DATA_DIR).glob("train-*"))
    if not files:
        return
    if files[0].suffix == ".arrow":
        with pa.memory_map(str(files[0])) as src:
            schema = pa.ipc.open_stream(src).schema
    else:
        schema = pq.read_schema(files[0])
    print("schema:\n" + str(schema.remove_metadata()))


def register(sub, common: argparse.ArgumentParser) -> None:
    i = sub.add_parser("inspect", parents=[common],
                       help="what a build holds: counts, lengths, loss mask, state statistics, rejects, shard check")
    i.add_argument("dir", help="the output directory of a finished build (hs-dataset build ... -o DIR)")
    i.add_argument("--plot", metavar="FILE.png", help="draw the token-norm histogram of every state and the length "
                                                      "histogram into a PNG (needs matplotlib)")
    i.add_argument("--sample-rows", type=int, default=32, metavar="N",
                   help="rows (spread over the build) read for the state statistics (default 32)")
    i.add_argument("--schema", action="store_true", help="also print the Arrow schema of the shards")
    i.add_argument("--layers", action="store_true", help="the layer pilot view: per captured layer, its mean token norm "
                                                         "and its cosine similarity to hidden_final and to the previous "
                                                         "captured layer (to pick aux layers from a pilot build)")
    i.set_defaults(fn=cmd_inspect)
