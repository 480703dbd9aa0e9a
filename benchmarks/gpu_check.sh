#!/usr/bin/env bash
# The GPU check in one line, on a machine that has torch and Triton but maybe no network, no Ray and
# no build tools:
#   bash benchmarks/gpu_check.sh [OUT_DIR] [gpu_check options]
# lays warpspec's folders out as the `warpspec` package in a temporary folder (symlinks, nothing is
# built or installed) and writes the report to OUT_DIR (default benchmarks/results).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-benchmarks/results}"
site="$(mktemp -d)"
mkdir "$site/warpspec"
ln -s "$root"/cluster/* "$site/warpspec/"
for part in workers kernels benchmarks training protos assets; do ln -s "$root/$part" "$site/warpspec/$part"; done
PYTHONPATH="$site" python3 -m warpspec.benchmarks.gpu_check --out "$out" "${@:2}"
