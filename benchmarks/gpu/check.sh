#!/usr/bin/env bash
# The prepared GPU check: bash benchmarks/gpu/check.sh RESULTS_DIR [--dry-run] [--skip-server]
# Runs benchmarks/gpu/gpu_check.py (kernels vs torch, 8B-shape decode eager/graphs, prefill, server),
# writes RESULTS_DIR/results.json and prints a table last. Killed at 470 s (the budget is 8 minutes).
# No network: torch, triton and kvfleet's pure-Python dependencies only. --dry-run: tiny shapes on the
# CPU under the Triton interpreter (what CI runs).
set -euo pipefail
if [ $# -lt 1 ]; then echo "usage: $0 RESULTS_DIR [--dry-run] [--skip-server]" >&2; exit 2; fi
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py=python3
mkdir -p "$1"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec timeout 470 "$py" "$here/gpu_check.py" "$@"
