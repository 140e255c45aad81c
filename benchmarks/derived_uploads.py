#!/usr/bin/env python
"""What a push of a derived version uploads next to the versions it comes from (issue 51, item 4).

    python benchmarks/derived_uploads.py                      # 3 versions of 24 rows, 1 MiB of states a row
    python benchmarks/derived_uploads.py --samples 48 --json benchmarks/results/derived-uploads.json

Three versions are built with the real builder from raw-token sources (hidden 1024, layers 1, 29, 57 + the
final state, 128 tokens a row: 1 MiB of states a row; one row per record batch, as the default byte budget
gives rows at Kimi width), their states random and different for every sample (:class:`UniqueStates`: no two
rows share bytes). Then ``hs-dataset derive`` writes a 50% subset of the first and an equal 3-way mix of all
three (as many rows as one version), and their published files are cut into content-defined chunks
(``benchmarks/xet_chunks.py``) and compared with the sources': the bytes an upload would send, beside the real
Xet client's own count (``hf_xet``, into a local CAS folder, no network) when it is installed. The ratio
reported is the upload over the bytes of the source versions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reversions  # noqa: E402  published(), xet_dedup()
import storage  # noqa: E402  make_model_dir(), make_source()

from hs_dataset.config import HiddenStatesConfig  # noqa: E402
from hs_dataset.derive.version import derive  # noqa: E402
from xet_chunks import shared_fraction  # noqa: E402
from hs_dataset.records import CaptureResult  # noqa: E402
from hs_dataset.write.driver import build  # noqa: E402

HIDDEN, TOKENS = 1024, 128
LAYERS = (1, 29, 57)


class UniqueStates:
    """A capture backend of random states, different for every sample (seeded by its id)."""

    name = "unique-random"

    def __init__(self, model_dir: Path):
        from hs_dataset.model_info import read_model_info

        self.info = read_model_info(str(model_dir))
        self.layers = LAYERS

    def capture(self, samples):
        for s in samples:
            g = torch.Generator().manual_seed(zlib.crc32(s.sample_id.encode()))
            states = torch.randn((len(LAYERS) + 1, s.num_tokens, HIDDEN), generator=g).to(torch.bfloat16)
            yield CaptureResult(s, self.layers, states, nonfinite=(0,) * (len(LAYERS) + 1))

    def versions(self) -> dict[str, str]:
        return {}

    def close(self) -> None:
        pass


def make_versions(work: Path, samples: int, names: str = "abc") -> list[Path]:
    """One version per name (sources ``src-<name>``), ``samples`` rows each, with tags."""
    model = storage.make_model_dir(work / "model", HIDDEN)
    outs = []
    for k, name in enumerate(names):
        src = storage.make_source(work / f"src-{name}.jsonl", samples, TOKENS, seed=k)
        out = work / name
        build(HiddenStatesConfig(model=str(model), layers=LAYERS, source=str(src), max_length=TOKENS, part_size=8,
                                 tags=True, max_shard_bytes=8 * 2**20, writer_batch_bytes=1),
              out, backend=UniqueStates(model), progress=False)
        outs.append(out)
    return outs


def upload_figures(olds: list[Path], new: Path, cas: Path, xet: bool = True) -> dict[str, float]:
    """The bytes a push of ``new`` uploads once ``olds`` are on the Hub (ours, and Xet's when installed)."""
    old_files = [f for s in olds for f in reversions.published(s)]
    f = shared_fraction(old_files, reversions.published(new))
    source_bytes = sum(p.stat().st_size for p in old_files)
    out: dict[str, float] = {"derived_bytes": f.bytes, "upload_bytes": f.upload_bytes, "source_bytes": source_bytes,
                             "upload_share_of_source": f.upload_bytes / source_bytes}
    measured = reversions.xet_dedup(old_files, reversions.published(new), cas) if xet else None
    if measured is not None:
        out["xet_new_bytes"] = measured["new_bytes"]
        out["xet_share_of_source"] = measured["new_bytes"] / source_bytes
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=24, help="rows per version (default 24)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--no-xet", action="store_true", help="leave out the real Xet client's count")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sources = make_versions(work, a.samples)
        derive([sources[0]], work / "half", budget=a.samples // 2, seed=3)
        derive(sources, work / "mix", weights=[1, 1, 1], budget=a.samples, seed=3)
        figures = {"samples": a.samples, "row_state_bytes": (len(LAYERS) + 1) * TOKENS * HIDDEN * 2,
                   "half": upload_figures(sources[:1], work / "half", work / "cas", not a.no_xet),
                   "mix": upload_figures(sources, work / "mix", work / "cas", not a.no_xet)}
    text = json.dumps(figures, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
