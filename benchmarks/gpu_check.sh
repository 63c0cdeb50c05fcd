#!/usr/bin/env bash
# One GPU check (benchmarks/gpu_check.py): pytest -m gpu tests/gpu, the graph bench, offline bf16 vs transformers
# generate and a served smoke test, in under 8 minutes, one summary table. --dry-run: the same plumbing on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" benchmarks/gpu_check.py "$@"
