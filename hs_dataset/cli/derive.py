"""``hs-dataset derive SRC [SRC ...] --output DIR``: a new version made of rows of existing ones (filters on tags
and statistics, a mix by weight, a sample budget, the flattest positions), without capturing anything again."""

from __future__ import annotations

import argparse
import shlex
import sys

from hs_dataset.cli.render import size, table

__all__ = ["cmd_derive", "print_tag_counts", "register"]

_SHOWN = 8  # values shown per tag column (the most frequent)


def print_tag_counts(counts: dict[str, dict], rows: int, estimated: str = "") -> None:
    """``{tag column: {value: rows}}`` as one table: each column's most frequent values and their rows."""
    if not counts:
        return
    print(f"tags:      rows by tag{estimated} (derive --where filters on them):")
    out = []
    for name, by_value in counts.items():
        ranked = sorted(by_value.items(), key=lambda kv: (-kv[1], str(kv[0])))
        shown = ranked[:_SHOWN]
        more = len(ranked) - len(shown)
        out += [(name, "null" if v is None else str(v), f"{n:,}", f"{n / max(rows, 1):.1%}") for v, n in shown]
        if more:
            out.append((name, f"({more} more values)", f"{sum(n for _, n in ranked[_SHOWN:]):,}", ""))
    for line in table(("tag", "value", "rows", "share"), out):
        print(line)


def cmd_derive(a: argparse.Namespace) -> int:
    from hs_dataset.derive.version import derive  # deferred: pyarrow, torch

    weights = [float(w) for w in a.weights.split(",")] if a.weights else None
    s = derive(a.sources, a.output, where=a.where, weights=weights, budget=a.budget, keep_flattest=a.keep_flattest,
               seed=a.seed, model=a.model, command="hs-dataset " + shlex.join(sys.argv[1:]) if sys.argv else None)
    per = ", ".join(f"{n:,} of {src}" for n, src in zip(s.rows_per_source, a.sources))
    print(f"derived:   {s.output}: {s.rows:,} rows ({per}), {size(s.bytes)}")
    if a.keep_flattest is not None:
        print(f"positions: {s.positions_masked_after:,} of {s.positions_masked_before:,} masked positions kept (the "
              f"flattest {a.keep_flattest:.0%}); {s.dropped_rows:,} rows left with none dropped")
    print(f"next:      hs-dataset verify {s.output}   |   hs-dataset push {s.output} org/name --version v1.1")
    return 0


def register(sub, common: argparse.ArgumentParser) -> None:
    c = sub.add_parser("derive", parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter,
                       help="a new version made of rows of existing ones: filters on tags and statistics, a mix by "
                            "weight, a sample budget, the flattest positions (the states' bytes kept as stored)",
                       epilog="examples:\n"
                              "  hs-dataset derive v1 --output v1-on --where \"tag_mode == 'on'\"\n"
                              "  hs-dataset derive v1 --output v1-half --budget 5000 --seed 0\n"
                              "  hs-dataset derive chat math code --output mix --weights 0.5,0.3,0.2 --budget 20000\n"
                              "  hs-dataset verify v1 --stats && hs-dataset derive v1 --output v1-flat "
                              "--where 'stat_entropy_mean > 0.5' --keep-flattest 0.5")
    c.add_argument("sources", nargs="+", metavar="SRC", help="finished builds or downloaded versions (one layout)")
    c.add_argument("--output", required=True, help="the new version's folder (absent or empty)")
    c.add_argument("--where", action="append", default=[], metavar="FILTER",
                   help="COLUMN OP VALUE over id, num_tokens, tag_* and stat_* columns (repeat: all hold), e.g. "
                        "\"tag_language in ['en', 'fr']\"")
    c.add_argument("--weights", help="each source's share of the rows, comma-separated (default: equal with --budget)")
    c.add_argument("--budget", type=int, help="rows to draw in all (default: every row that passes, or the largest "
                                              "mix with --weights)")
    c.add_argument("--keep-flattest", type=float, metavar="SHARE",
                   help="keep masked only this share (0-1] of the masked positions, those where the target's "
                        "distribution has the highest entropy (the loss mask narrowed, the states untouched)")
    c.add_argument("--seed", type=int, default=0, help="which rows a budget or mix draws (default 0)")
    c.add_argument("--model", help="with hidden_final statistics: the model directory (default: the recorded path)")
    c.set_defaults(fn=cmd_derive)
