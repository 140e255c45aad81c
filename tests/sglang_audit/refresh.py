"""Refresh tests/sglang_audit/releases/<version>.json from SGLang's wheels on PyPI:

    python -m tests.sglang_audit.refresh 0.5.24            # one release (a new one: then run the audit test)
    python -m tests.sglang_audit.refresh --all             # every release kept
    python -m tests.sglang_audit.refresh --from-dir DIR 0.5.23   # an unpacked wheel already at DIR/0.5.23

Each wheel (~40 MB) is downloaded with ``pip download --no-deps`` into a cache folder (``--cache``, default
``~/.cache/hs_dataset/sglang-wheels``) and only ``sglang/srt/`` is unpacked. What is kept per release is what
:func:`tests.sglang_audit.touchpoints.extract` found (a few dozen excerpts, with each file's Apache-2.0 header).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.sglang_audit.touchpoints import RELEASES, extract

CACHE = Path.home() / ".cache" / "hs_dataset" / "sglang-wheels"


def unpack(version: str, cache: Path) -> Path:
    """``sglang==version``'s ``sglang/srt/`` under ``cache/src/<version>`` (downloaded once)."""
    dest = cache / "src" / version
    if (dest / "sglang" / "srt").is_dir():
        return dest
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"sglang=={version}", "-d",
                        str(wheels)], check=True)
        found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    with zipfile.ZipFile(found[0]) as z:
        z.extractall(dest, [n for n in z.namelist() if n.startswith("sglang/srt/") and n.endswith(".py")])
    return dest


def write(version: str, root: Path) -> Path:
    out = RELEASES / f"{version}.json"
    data = extract(root, version)
    data["license"] = ("Excerpts of SGLang (https://github.com/sgl-project/sglang), Apache License 2.0; each file's "
                       "own header is kept under files")
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("versions", nargs="*")
    ap.add_argument("--all", action="store_true", help="every release under releases/")
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--from-dir", type=Path, help="unpacked wheels at DIR/<version> instead of downloading")
    a = ap.parse_args(argv)
    versions = list(a.versions) + ([p.stem for p in sorted(RELEASES.glob("*.json"))] if a.all else [])
    for v in versions:
        root = a.from_dir / v if a.from_dir else unpack(v, a.cache)
        print(write(v, root))


if __name__ == "__main__":
    main()
