#!/usr/bin/env bash
# The SGLang releases the CPU tests import (tests/capture/test_sglang_versions.py) and read
# (tests/sglang_audit), unpacked into a cache folder; nothing is installed into the venv:
#   bash .ci/sglang_site.sh [CACHE]        (default ~/.cache/hs_dataset; CI: cache this folder)
# CACHE/sglang-site/<version>/: the whole wheel (for imports); CACHE/sglang-site/deps/: the pure-Python modules
# sglang.srt.server_args imports that the project's venv lacks; CACHE/sglang-wheels/src/<version>/: sglang/srt only
# (the audit's source check). About 90 MB of downloads, from PyPI only.
set -euo pipefail
cache=${1:-$HOME/.cache/hs_dataset}
site=$cache/sglang-site; wheels=$cache/sglang-wheels
mkdir -p "$site/deps" "$wheels/wheels" "$wheels/src"
for v in 0.5.17 0.5.23; do
  [ -d "$site/$v/sglang" ] && continue
  python -m pip download -q --no-deps "sglang==$v" -d "$wheels/wheels"
  python -m zipfile -e "$wheels/wheels"/sglang-$v-*.whl "$site/$v"
  mkdir -p "$wheels/src/$v" && cp -r "$site/$v/sglang" "$wheels/src/$v/"
done
if [ ! -d "$site/deps/msgspec" ]; then
  tmp=$(mktemp -d)
  python -m pip download -q --no-deps -d "$tmp" msgspec orjson pybase64 starlette pyzmq ipython traitlets
  for w in "$tmp"/*.whl; do python -m zipfile -e "$w" "$site/deps"; done
  rm -rf "$tmp"
fi
echo "$site"
