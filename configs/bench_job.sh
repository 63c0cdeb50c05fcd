#!/usr/bin/env bash
# Multi-node serving benchmark as a Ray job: starts `raymoe serve` on the cluster (rank actors placed on the GPU
# nodes, the HTTP server on the job's node, bound to 127.0.0.1), waits until it is healthy, runs
# `raymoe bench serve` with MT-Bench two-turn chats, prints the figures and stops the server.
# The cluster requires Ray's token (configs/cluster.yaml, configs/kuberay-rayservice.yaml) and its dashboard is
# reachable only through a tunnel (`ray dashboard configs/cluster.yaml`, or `kubectl port-forward ... 8265`):
#   RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 --working-dir configs \
#       --runtime-env-json '{"env_vars": {"MODEL": "/models/Qwen3-30B-A3B", "DP": "8"}}' -- bash bench_job.sh
# Against an already deployed Serve app (configs/serve.yaml, configs/kuberay-rayservice.yaml), run only the
# benchmark:  RAY_AUTH_MODE=token ray job submit --address http://127.0.0.1:8265 -- raymoe bench serve \
#   --base-url http://SERVE:8000 ...
set -euo pipefail

# `raymoe serve --address auto` joins the cluster as a Ray driver: it must present the cluster's token too (the
# token comes from RAY_AUTH_TOKEN, set by KubeRay, or ~/.ray/auth_token, copied by the cluster launcher).
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

MODEL="${MODEL:?set MODEL to a model folder readable on every node}"
DP="${DP:-4}"
TP="${TP:-1}"
PORT="${PORT:-8000}"
CONCURRENCY="${CONCURRENCY:-64}"
NUM_PROMPTS="${NUM_PROMPTS:-80}"
OUTPUT_LEN="${OUTPUT_LEN:-256}"
DATASET="${DATASET:-mt_bench_questions.jsonl}"
OUT="${OUT:-/tmp/raymoe-bench-serve.json}"

raymoe serve --address auto --model "$MODEL" --dp "$DP" --tp "$TP" --host 127.0.0.1 --port "$PORT" &
SERVER=$!
trap 'kill -INT "$SERVER" 2>/dev/null; wait "$SERVER" || true' EXIT

for _ in $(seq 1 900); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
  kill -0 "$SERVER" 2>/dev/null || { echo "raymoe serve exited" >&2; exit 1; }
  sleep 2
done

DATASET_ARGS=()
if [[ -f "$DATASET" ]]; then DATASET_ARGS=(--dataset-path "$DATASET"); fi
raymoe bench serve --base-url "http://127.0.0.1:$PORT" --concurrency "$CONCURRENCY" --num-prompts "$NUM_PROMPTS" \
  --output-len "$OUTPUT_LEN" "${DATASET_ARGS[@]}" --output-json "$OUT"
cat "$OUT"
