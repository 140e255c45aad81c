#!/bin/bash
# Run GPU tests on the lent device, from the project's root, logs and JSON reports into $OUT:
#   bash tests/gpu/device.sh NAME LIMIT_S [pytest targets...]      (default targets: tests/gpu)
# e.g. bash tests/gpu/device.sh suite 570 tests/gpu/test_sglang.py tests/gpu/test_tokenize_workers.py
# Prints one line per test and the failures' assertion lines; the whole log is $OUT/NAME.log (the
# tests write their figures to $OUT/gpu_*.json). LIMIT_S stops pytest before the device's 600 s per call.
name=$1; limit=$2; shift 2
[ $# -gt 0 ] || set -- tests/gpu
source .gpu/device-setup.sh >/dev/null || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
set -o pipefail
timeout "$limit" python3 -m pytest -m gpu -v -rs --durations=0 -p no:cacheprovider "$@" 2>&1 | tee "$OUT/$name.log" \
  | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^E " | head -150
echo "rc=$?"
