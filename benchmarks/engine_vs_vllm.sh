#!/usr/bin/env bash
# raycluster's `serve` against vLLM's CPU build on the same checkpoint and the same client load (issue 49, E1 E2 E6),
# alternated round by round: A = vLLM pinned to one CPU, B = raycluster on the 1.0-CPU lab host alone, C = raycluster
# on the 3 unequal lab hosts (1.0 / 0.5 / 0.25); every service measured with `raycluster bench --serve --json` at the
# same concurrency, prompt and output lengths, greedy and sampled (T 0.8, top-p 0.95), and one request at a time.
#
# Usage: benchmarks/engine_vs_vllm.sh [OUT]   (default /tmp/engine-vs-vllm)
#   SHAPE=qwen2.5-0.5b (benchmarks/real_shapes.py)  ROUNDS=3  REQUESTS=16  CONCURRENCY=16  PROMPT=128  OUTPUT=32
#   ONE_REQUESTS=4 (the one-at-a-time run)  QUOTAS=1.0,0.5,0.25  SERVICES="vllm one three" (vllm alone: no lab)
#   VLLM_CPU=N (default: the last CPU)  VLLM_KV_GIB=4  VLLM_PORT=8011  PYTHON (raycluster's venv)
#   SERVE_FLAGS (more `raycluster serve` flags for both lab services, e.g. --step-tokens=2048 --prefill-chunk=128)
#   WORKLOAD=e4: issue 49's E4 instead (benchmarks/prefill_beside_decodes.py: an E4_PROMPT-token prompt (1024) alone
#   and beside CONCURRENCY decoding streams, E4_ROUNDS times (3)); OUT/runs/SERVICE-e4-rN.json
#   CPU_BY_PROCESS=1: each run's CPU by process on the whole machine (benchmarks/cpu_by_process.py), OUT/runs/*.cpu.json
# Needs benchmarks/vllm_cpu_env.sh's venv (made here when missing) and, for "one"/"three", the whole machine for
# the Docker lab (RAYCLUSTER_LAB_NAME etc. as the lab tests take them). Every run's document: OUT/runs/*.json;
# the table: benchmarks/engine_vs_vllm_summary.py OUT (printed at the end, OUT/summary.json).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/engine-vs-vllm}
SHAPE=${SHAPE:-qwen2.5-0.5b} ROUNDS=${ROUNDS:-3} REQUESTS=${REQUESTS:-16} CONCURRENCY=${CONCURRENCY:-16}
PROMPT=${PROMPT:-128} OUTPUT=${OUTPUT:-32} ONE_REQUESTS=${ONE_REQUESTS:-4} QUOTAS=${QUOTAS:-1.0,0.5,0.25}
SERVICES=${SERVICES:-vllm one three} VLLM_CPU=${VLLM_CPU:-$(($(nproc) - 1))} VLLM_PORT=${VLLM_PORT:-8011}
WORKLOAD=${WORKLOAD:-saturation} E4_PROMPT=${E4_PROMPT:-1024} E4_ROUNDS=${E4_ROUNDS:-3}
MAX_SEQ=$((PROMPT + OUTPUT)) SLOTS=$CONCURRENCY
if [ "$WORKLOAD" = e4 ]; then # the long prompt and the streams' 8 + 200 tokens fit; the prompt beside the streams
  MAX_SEQ=$((E4_PROMPT + 256)) SLOTS=$((CONCURRENCY + 1))
fi
mkdir -p "$OUT/runs"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} # this tree's CLI and benchmarks, whichever venv runs them
source benchmarks/lab_with_quotas.sh # py, rc, lab_with_quotas
benchmarks/vllm_cpu_env.sh
source benchmarks/vllm_cpu_env.sh --env-only # VLLM_PY, VLLM_LD_PRELOAD

MODEL=$OUT/model-$SHAPE
[ -f "$MODEL/model.safetensors" ] || "$py" benchmarks/real_shapes.py "$SHAPE" "$MODEL"
KEY=$OUT/vllm-key
[ -s "$KEY" ] || (umask 077 && echo "sk-vllm-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')" > "$KEY")

VLLM_PID=
start_vllm() { # pinned to one CPU: taskset for the API process, the OpenMP threads bound to the same CPU
  VLLM_CPU_OMP_THREADS_BIND=$VLLM_CPU VLLM_CPU_KVCACHE_SPACE=${VLLM_KV_GIB:-4} LD_PRELOAD=$VLLM_LD_PRELOAD \
    taskset -c "$VLLM_CPU" "$VLLM_PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --dtype bfloat16 \
    --max-model-len "$MAX_SEQ" --api-key "$(cat "$KEY")" --host 127.0.0.1 --port "$VLLM_PORT" \
    > "$OUT/vllm.log" 2>&1 &
  VLLM_PID=$!
  local waited=0 # its first start compiles the model (minutes on one CPU; cached under ~/.cache/vllm after)
  until curl -sf -m 5 -o /dev/null -H "Authorization: Bearer $(cat "$KEY")" "http://127.0.0.1:$VLLM_PORT/v1/models"; do
    kill -0 "$VLLM_PID" 2> /dev/null || { tail -30 "$OUT/vllm.log" >&2; exit 1; }
    [ $((waited += 5)) -lt 1200 ] || { echo "vLLM not up after 1200 s (see $OUT/vllm.log)" >&2; exit 1; }
    sleep 5
  done
}
stop_vllm() { [ -z "$VLLM_PID" ] || { kill "$VLLM_PID" 2> /dev/null && wait "$VLLM_PID" || true; VLLM_PID=; }; }
trap stop_vllm EXIT

# bench NAME RUN_FLAGS... -- TARGET_FLAGS...: one `bench --serve` saturation run, its document kept
bench() {
  local name=$1 f="$OUT/runs/$1.json"
  shift
  local wrap=()
  [ -z "${CPU_BY_PROCESS:-}" ] || wrap=("$py" benchmarks/cpu_by_process.py --threads-of _StageActor --out "$OUT/runs/$name.cpu.json" --)
  timeout 1800 "${wrap[@]}" "$py" -m raycluster_cli.cli bench --serve --rates= --prompt-tokens="$PROMPT" \
    --output-tokens="$OUTPUT" "$@" --json --save-result "$f" > "$OUT/runs/$name.out" 2> "$OUT/runs/$name.err" || echo "$name: rc $?" >&2
  "$py" - "$f" "$name" << 'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1])); r = d["runs"][0]
except (OSError, ValueError, LookupError) as exc:
    sys.exit(print(sys.argv[2], "no run:", exc, flush=True))
print(sys.argv[2], round(r["output_tokens_per_s"], 1), "tok/s; TPOT p50", round(1000 * r["latency_s"]["tpot"]["p50"], 1),
      "ms; TTFT p50", round(1000 * r["latency_s"]["ttft"]["p50"]), "ms; failed", r["failed"], flush=True)
PY
}

# e4 SERVICE ROUND URL KEY_FILE: issue 49's E4 on one service
e4() {
  local f="$OUT/runs/$1-e4-r$2.json"
  "$py" benchmarks/prefill_beside_decodes.py --url "$3" --api-key-file "$4" --prompt-tokens "$E4_PROMPT" \
    --streams "$CONCURRENCY" --rounds "$E4_ROUNDS" --out "$f" > /dev/null 2> "$OUT/runs/$1-e4-r$2.err" || echo "$1-e4-r$2: rc $?" >&2
  "$py" -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[2], 'TTFT alone', d['ttft_alone_s'],
  'beside', d['ttft_beside_s'], 'ratio', d['ttft_beside_over_alone_p50'], '; TPOT', d['tpot_without_ms_p50'], '->',
  d['tpot_while_prefilling_ms_p50'], 'ms, ratio', d.get('tpot_while_over_without_p50'), flush=True)" "$f" "$1-e4-r$2" || true
}

# measure SERVICE ROUND TARGET_FLAGS...: a warm-up (not counted), greedy, sampled, one at a time
measure() {
  local s=$1 n=$2
  shift 2
  bench "$s-warmup-r$n" --requests="$CONCURRENCY" --concurrency="$CONCURRENCY" "$@"
  bench "$s-greedy-r$n" --requests="$REQUESTS" --concurrency="$CONCURRENCY" "$@"
  bench "$s-sampled-r$n" --requests="$REQUESTS" --concurrency="$CONCURRENCY" --temperature=0.8 --top-p=0.95 "$@"
  bench "$s-single-r$n" --requests="$ONE_REQUESTS" --concurrency=1 "$@"
}

# the lab's raycluster service on INVENTORY: the cluster afresh (its hosts' quotas), `serve` in bf16, measured
lab_round() {
  local s=$1 n=$2 inventory=$3
  rc down -i "$inventory" --json > /dev/null || true
  rc up -i "$inventory" --json > "$OUT/runs/up-$s-r$n.json"
  rc serve --model-path="$MODEL" --max-seq="$MAX_SEQ" --slots="$SLOTS" --dtype=bfloat16 ${SERVE_FLAGS:-} \
    -i "$inventory" --json > "$OUT/runs/serve-$s-r$n.json"
  if [ "$WORKLOAD" = e4 ]; then
    local url key # the service's address and key, as `serve` wrote them
    read -r url key < <("$py" -c "import json, sys; d = json.load(open(sys.argv[1])); print(d['url'], d['api_key_file'])" \
      "$OUT/runs/serve-$s-r$n.json")
    e4 "$s" "$n" "$url" "$key"
  else
    measure "$s" "$n" -i "$inventory"
  fi
  rc status -i "$inventory" --json > "$OUT/runs/status-$s-r$n.json" || true # the split it ran on
  rc serve --stop -i "$inventory" --json > /dev/null
  rc down -i "$inventory" --json > /dev/null
}

THREE= ONE=
if [[ " $SERVICES " == *" one "* || " $SERVICES " == *" three "* ]]; then
  lab_with_quotas "$QUOTAS" # sets inv: every host, each with its quota
  THREE=$inv ONE=$OUT/one-host.yaml
  "$py" -c "import sys, yaml; d = yaml.safe_load(open(sys.argv[1])); d['hosts'] = d['hosts'][:1]
yaml.safe_dump(d, open(sys.argv[2], 'w'), sort_keys=False)" "$THREE" "$ONE" # lab-h1: the 1.0-CPU host
  rc down -i "$THREE" --json > /dev/null
fi
echo "shape $SHAPE; $WORKLOAD: $REQUESTS requests, $CONCURRENCY at once, $PROMPT prompt + $OUTPUT output tokens (e4: a" \
  "$E4_PROMPT-token prompt beside $CONCURRENCY streams); vLLM on CPU $VLLM_CPU;" \
  "LD_PRELOAD=${VLLM_LD_PRELOAD:-none}; services: $SERVICES; $ROUNDS rounds" | tee "$OUT/setup.txt"
for n in $(seq 0 $((ROUNDS - 1))); do
  for s in $SERVICES; do
    case $s in
      vllm)
        start_vllm # a fresh process each round, as the lab's services are
        if [ "$WORKLOAD" = e4 ]; then
          e4 vllm "$n" "http://127.0.0.1:$VLLM_PORT/v1" "$KEY"
        else
          measure vllm "$n" --url "http://127.0.0.1:$VLLM_PORT/v1" --api-key-file "$KEY" -i "${THREE:-inventory.example.yaml}"
        fi
        stop_vllm
        ;;
      one) lab_round one "$n" "$ONE" ;;
      three) lab_round three "$n" "$THREE" ;;
      *) echo "SERVICES: '$s' is not one of vllm, one, three" >&2 && exit 2 ;;
    esac
  done
done
[ "$WORKLOAD" = e4 ] || "$py" benchmarks/engine_vs_vllm_summary.py "$OUT"
