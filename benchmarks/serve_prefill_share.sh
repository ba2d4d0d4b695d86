#!/usr/bin/env bash
# How much of four-at-a-time's gap (issue 31's S4/S5) is the prompts' prefill: one 3-host service (quotas
# 1.0 / 0.5 / 0.25, the model of serve_targets.py), after two 64-request warm-ups (it re-splits itself in them),
# ROUNDS rounds of one and four at a time, with the usual prompts (16-64 tokens) and with prompts of 1-4, one line
# per run: tok/s, TPOT p50, the step anatomy's round trip, steps in flight and compute per stage (and its compute
# in steps when no other stage computed / when another did, and the share of its compute beside another's).
# Usage: RAYCLUSTER_LAB_NAME=rc-ex RAYCLUSTER_LAB_SUBNET=10.91.0.0/24 [SERVE_FLAGS=...] benchmarks/serve_prefill_share.sh [ROUNDS] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
OUT=${2:-/tmp/serve-prefill-share}
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
R="$PYTHON -m raycluster_cli"
source benchmarks/serve_lab3.sh
INV=$LAB_INVENTORY
timeout 1200 $R up -i "$INV" --json > "$OUT/up.json"
timeout 1200 $R serve --model-path="$MODEL" --max-seq=256 --slots=16 --rebalance-period=10 ${SERVE_FLAGS:-} -i "$INV" --json \
  > "$OUT/serve.json"
B="timeout 900 $R bench --serve --rates= -i $INV --json"
for warm in 0 1; do $B --requests=64 --prompt-tokens=16:64 --output-tokens=32:96 > "$OUT/warm-$warm.json"; done
for round in $(seq 0 $((ROUNDS - 1))); do
  for kind in usual short; do
    prompts=$([ "$kind" = usual ] && echo 16:64 || echo 1:4)
    for c in 1 4; do
      f="$OUT/$round-$kind-c$c.json"
      $B --prompt-tokens="$prompts" --output-tokens=32:96 --requests=$((c == 1 ? 8 : 32)) --concurrency=$c > "$f"
      $PYTHON - "$f" "$round $kind c$c" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); r = d["runs"][0]; a = list(r["anatomy"].values())[-1]
print(sys.argv[2], round(r["output_tokens_per_s"], 1), "tok/s, TPOT p50", round(r["latency_s"]["tpot"]["p50"] * 1000, 1),
      "ms, round trip", a["round_trip_ms"], "ms, in flight", a["in_flight"], ", compute", [s["compute_ms"] for s in a["stages"]],
      ", alone / beside", [(s.get("compute_alone_ms"), s.get("compute_beside_ms"), s.get("beside_share")) for s in a["stages"]],
      ", blocks", [s["blocks"] for s in r["stages"]], ", load", open("/proc/loadavg").read().split()[0],
      ", pipelines changed", d.get("pipelines_changed"), flush=True)
PY
    done
  done
done
# the ingress's full garbage collections over the whole service's life, and each stage's seconds in them
$PYTHON - "$INV" "$(grep -o '"url": *"[^"]*"' "$OUT/serve.json" | head -1 | cut -d'"' -f4)" <<'PY' || true
import asyncio, json, sys
from raycluster_cli.config.inventory import load
from raycluster_cli.verbs.serve_bench import ServiceClient, target_of
body = asyncio.run(ServiceClient(target_of(load(sys.argv[1]).inventory, None, sys.argv[2]), 60).status())
print("ingress gc", json.dumps(body.get("ingress_gc")), "stages' gc s", [[s.get("gc_s") for s in p["stages"]] for p in body["pipelines"]])
PY
$R serve --stop -i "$INV" --json > /dev/null
