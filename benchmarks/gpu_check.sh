#!/usr/bin/env bash
# The GPU check in one line, on a machine that has torch and Triton but maybe no network and no Ray:
#   bash benchmarks/gpu_check.sh [OUT_DIR] [gpu_check options]
# installs warpspec's own files (no dependencies) into a temporary folder and writes the report to
# OUT_DIR (default benchmarks/results).
set -euo pipefail
out="${1:-benchmarks/results}"
site="$(mktemp -d)"
python3 -m pip install --quiet --no-deps --no-build-isolation --no-index --target "$site" .
PYTHONPATH="$site" python3 -m warpspec.benchmarks.gpu_check --out "$out" "${@:2}"
