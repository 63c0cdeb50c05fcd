#!/usr/bin/env bash
# Runs the CPU-sized benchmark set; results land in bench_results/*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
R=.venv/bin/raymoe
$R bench offline --num-prompts 64 --input-len 10 --output-len 64
$R bench offline --num-prompts 64 --input-len 10 --output-len 64 --tp 1 --dp 2 --ep 2 --skip-hf \
  --output-json bench_results/offline_dp2_ep2.json
$R bench fanout --dp 2
$R bench graph
$R bench overlap --ep 2 --batch-sizes 16,64,128 --latency-ms 0,1,2,5
