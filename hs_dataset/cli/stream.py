"""``hs-dataset build --stream [ray:NAME]``: trainers read the rows while the build writes them.

The work is :mod:`hs_dataset.stream` (the publisher, the spool, the Ray relay); this module reads
the options and makes the build's :class:`~hs_dataset.write.sink.RowSink`.
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from hs_dataset.errors import ConfigError

if TYPE_CHECKING:
    from hs_dataset.stream.publish import StreamPublisher

__all__ = ["add_stream_args", "parse_bytes", "stream_sink"]

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
DEFAULT_STREAM_BYTES = "4GiB"  # = hs_dataset.stream.publish.DEFAULT_BUDGET_BYTES (not imported: it pulls in torch)
DEFAULT_STALL_S = 30.0


def parse_bytes(text: str) -> int:
    """``4GiB``, ``512MiB``, ``1g``, ``1000000`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r}: a size in bytes, e.g. 4GiB, 512MiB or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def add_stream_args(parser: argparse.ArgumentParser) -> None:
    """``--stream``, ``--stream-bytes`` and ``--stream-stall`` for ``hs-dataset build``."""
    g = parser.add_argument_group("train while it builds (docs/streaming.md)")
    g.add_argument("--stream", nargs="?", const="local", metavar="ray:NAME",
                   help="hand every row as it is generated to the trainers reading this build "
                        "(hs_dataset.open_stream(OUTPUT)) on this node; ray:NAME: also to trainers on other nodes of "
                        "the Ray cluster this node is in (open_stream('ray:NAME'); needs pip install 'hs-dataset[ray]')")
    g.add_argument("--stream-bytes", type=parse_bytes, default=parse_bytes(DEFAULT_STREAM_BYTES), metavar="SIZE",
                   help=f"the most bytes of rows held in /dev/shm for the trainers; beyond it the build waits for "
                        f"them (default {DEFAULT_STREAM_BYTES})")
    g.add_argument("--stream-stall", type=float, default=DEFAULT_STALL_S, metavar="SECONDS",
                   help=f"a trainer that takes no row for this long while the build waits is left behind: it reads "
                        f"its rows from data/ once committed (default {DEFAULT_STALL_S:g})")


def stream_sink(a: argparse.Namespace, scaleout: bool) -> StreamPublisher | None:
    """The build's stream publisher for ``--stream`` (None without it); ``ray:NAME`` starts the relay too.

    Raises:
        ConfigError: ``--stream`` with many workers, or an unknown ``--stream`` value, or Ray missing.
    """
    if a.stream is None:
        return None
    if scaleout:
        raise ConfigError("--stream streams one builder's rows: leave out --workers/--worker-index/--ray (trainers on "
                          "other nodes: --stream ray:NAME)")
    from hs_dataset.stream.publish import StreamPublisher  # deferred: imports torch, pyarrow

    if a.stream.startswith("ray:") and len(a.stream) > 4:
        from hs_dataset.stream.relay import start_relay  # optional: Ray

        start_relay(a.stream[4:], a.output)
    elif a.stream != "local":
        raise ConfigError(f"--stream {a.stream!r}: give nothing (trainers on this node) or ray:NAME (any node of a Ray "
                          "cluster)")
    return StreamPublisher(budget_bytes=a.stream_bytes, stall_s=a.stream_stall)
