#!/usr/bin/env bash
# configs/bench_job.sh as a real Ray Job, on a throwaway local Ray head with token authentication.
#
#   benchmarks/ray_job_bench.sh            (from the repository root; about 2-3 minutes on 2 cores)
#
# 1. makes a tiny seeded checkpoint (the job's MODEL) and a random Ray token kept in this script's environment
#    only (RAY_AUTH_TOKEN; ~/.ray/auth_token is neither read nor written);
# 2. starts `ray start --head --block` with RAY_AUTH_MODE=token, its own --temp-dir and free ports, every port
#    bound to 127.0.0.1 (node address, dashboard / Jobs API);
# 3. checks the Jobs API refuses a caller without the token (HTTP 401), then submits the README's command:
#      ray job submit --address http://127.0.0.1:PORT --working-dir configs -- bash bench_job.sh
#    with small sizes in --runtime-env-json env_vars (the job script reads them); `ray job submit` carries the
#    token from RAY_AUTH_TOKEN, and the job's processes inherit the head's environment, so `raymoe serve
#    --address auto` inside the job joins the cluster with the same token;
# 4. checks the job SUCCEEDED and its results JSON reports every request completed and zero errors;
# 5. stops the head by its own process id (never `ray stop`, which stops every Ray process of this user on the
#    machine, other people's clusters included), then any leftover process of this --temp-dir, by id.
#
# raymoe inside the job: the working dir is configs/, so the job imports raymoe through PYTHONPATH (this
# checkout, set in env_vars) and finds the `raymoe` command on PATH (this script's Python environment, inherited
# by the head). On a real cluster the package is installed on every node instead (configs/cluster.yaml,
# configs/Dockerfile). Environment knobs: PYTHON (default .venv/bin/python, else python3), DP, CONCURRENCY,
# NUM_PROMPTS, OUTPUT_LEN.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
PYTHON="$(command -v "$PYTHON")"
export PATH="$(dirname "$PYTHON"):$PATH"           # `ray` and `raymoe` of the same environment
DP="${DP:-2}" CONCURRENCY="${CONCURRENCY:-8}" NUM_PROMPTS="${NUM_PROMPTS:-16}" OUTPUT_LEN="${OUTPUT_LEN:-32}"

WORK="$(mktemp -d /tmp/rmjob.XXXX)"                # short: Ray's socket paths live under the temp dir
free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
GCS=$(free_port) DASH=$(free_port) CLIENT=$(free_port) AGENT=$(free_port) AGENT_GRPC=$(free_port)
METRICS=$(free_port) NODE_MGR=$(free_port) OBJ_MGR=$(free_port) RENV=$(free_port) SERVE_PORT=$(free_port)

export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN="$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')"
export RAY_AUTH_TOKEN
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 GLOO_SOCKET_IFNAME=lo

HEAD="" PASSED=0
stop_head() {
  if [[ -n "$HEAD" ]] && kill -0 "$HEAD" 2>/dev/null; then
    kill -TERM "$HEAD"; wait "$HEAD" 2>/dev/null || true
  fi
  # Anything of this head still running (matched by its unique temp dir), stopped by id.
  for sig in TERM KILL; do
    for pid in $(pgrep -f -- "$WORK" || true); do kill -"$sig" "$pid" 2>/dev/null || true; done
    sleep 2
  done
  left=$(pgrep -f -- "$WORK" | wc -l || true)
  echo "== head stopped; processes of $WORK left: $left"
  if [[ "$PASSED" == 1 ]]; then rm -rf "$WORK"; else echo "logs kept in $WORK"; fi
}
trap stop_head EXIT

echo "== checkpoint"
MODEL="$(PYTHONPATH="$ROOT" "$PYTHON" -m raymoe.cli make-checkpoint --out "$WORK/qwen3_moe_tiny" 2>/dev/null)"
echo "$MODEL"

echo "== ray start --head (token auth, temp dir $WORK, dashboard 127.0.0.1:$DASH)"
ray start --head --block --node-ip-address=127.0.0.1 --port="$GCS" --temp-dir="$WORK/ray" --num-cpus=8 \
  --num-gpus=0 --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port="$DASH" \
  --ray-client-server-port="$CLIENT" --dashboard-agent-listen-port="$AGENT" \
  --dashboard-agent-grpc-port="$AGENT_GRPC" --metrics-export-port="$METRICS" --node-manager-port="$NODE_MGR" \
  --object-manager-port="$OBJ_MGR" --runtime-env-agent-port="$RENV" --disable-usage-stats \
  >"$WORK/head.log" 2>&1 &
HEAD=$!
for _ in $(seq 1 90); do
  code=$(curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $RAY_AUTH_TOKEN" \
         "http://127.0.0.1:$DASH/api/version" || true)
  [[ "$code" == 200 ]] && break
  kill -0 "$HEAD" 2>/dev/null || { cat "$WORK/head.log"; echo "FAILED: ray start exited"; exit 1; }
  sleep 1
done
[[ "$code" == 200 ]] || { tail -20 "$WORK/head.log"; echo "FAILED: dashboard not up"; exit 1; }
echo "head up (pid $HEAD)"

no_token=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$DASH/api/jobs/")
echo "== Jobs API without the token: HTTP $no_token"
[[ "$no_token" == 401 || "$no_token" == 403 ]] || { echo "FAILED: the Jobs API answered without a token"; exit 1; }

echo "== pre-flight job: which raymoe the job imports and runs"
ray job submit --address "http://127.0.0.1:$DASH" --working-dir configs \
  --runtime-env-json "{\"env_vars\": {\"PYTHONPATH\": \"$ROOT\"}}" -- \
  bash -c 'python -c "import raymoe; print(\"raymoe module:\", raymoe.__file__)"; echo "raymoe command: $(command -v raymoe)"' \
  2>&1 | grep "^raymoe "

OUT="$WORK/bench-serve.json"
ENV_JSON=$(printf '{"env_vars": {"MODEL": "%s", "DP": "%s", "PORT": "%s", "CONCURRENCY": "%s", "NUM_PROMPTS": "%s", "OUTPUT_LEN": "%s", "DATASET": "none.jsonl", "OUT": "%s", "PYTHONPATH": "%s"}}' \
  "$MODEL" "$DP" "$SERVE_PORT" "$CONCURRENCY" "$NUM_PROMPTS" "$OUTPUT_LEN" "$OUT" "$ROOT")
echo "== ray job submit --address http://127.0.0.1:$DASH --working-dir configs --runtime-env-json '$ENV_JSON' -- bash bench_job.sh"
JOB_ID="raymoe-bench-$(date +%s)"
set +e
ray job submit --address "http://127.0.0.1:$DASH" --submission-id "$JOB_ID" --working-dir configs \
  --runtime-env-json "$ENV_JSON" -- bash bench_job.sh >"$WORK/job.log" 2>&1
SUBMIT_RC=$?
set -e
# The submission, the benchmark's summary lines and the verdict (the full log: $WORK/job.log, removed at exit).
grep -v "graph/s" "$WORK/job.log" | grep -E "Uploading|Job submission|Submitted|^requests|throughput|tok/s|TTFT|ITL|TPOT|latency|Job '|raymoe serve" \
  | grep -v '^ *"' | sed -e 's/\x1b\[[0-9;]*m//g' || true
echo "ray job submit exit status: $SUBMIT_RC"

STATUS=$(curl -s -H "Authorization: Bearer $RAY_AUTH_TOKEN" "http://127.0.0.1:$DASH/api/jobs/$JOB_ID" \
  | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin).get("status"))' || true)
echo "== Jobs API status of $JOB_ID: ${STATUS:-unknown}"
[[ "$STATUS" == SUCCEEDED ]] || { echo "FAILED: job did not succeed"; exit 1; }
[[ -f "$OUT" ]] || { echo "FAILED: no results JSON at $OUT"; exit 1; }
"$PYTHON" - "$OUT" "$NUM_PROMPTS" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"== results {sys.argv[1]}: {s['completed']}/{s['requests']} completed, {s['errors']} errors; "
      f"{s['output_token_throughput']:.0f} output tok/s, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
      f"TPOT p50 {s['tpot_ms']['p50']:.1f} ms")
assert s["errors"] == 0 and s["completed"] == s["requests"] == int(sys.argv[2]), s
mkdir = __import__("pathlib").Path("bench_results")
mkdir.mkdir(exist_ok=True)
(mkdir / "ray_job_bench.json").write_text(json.dumps(s, indent=2) + "\n")
EOF
PASSED=1
echo "PASS"
