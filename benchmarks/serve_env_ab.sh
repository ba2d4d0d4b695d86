#!/usr/bin/env bash
# Ray Serve's in-process settings A/B on the 3-host lab (quotas 1.0 / 0.5 / 0.25, the model of serve_targets.py):
# per round, A (the containers as `up` makes them) then B (the in-process part of Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED, or ENV_B):
# the cluster down and up with the inventory's `env`, a service, two 64-request warm-ups, then 8 requests one at a
# time, 32 four at a time and 32 at once; one line per run: tok/s, TPOT p50, the step anatomy's round trip, the
# stages' compute and hand-offs, the ingress loop's lag, the split, each node's CPU against its quota and the front
# end's CPU per output token (the ingress, Serve's proxy).
# QUOTAS_B: B's hosts' CPU quotas instead of A's (e.g. 0.5,0.25,0.125: the same ratios on less of the machine, so
# the three stages computing at once no longer need more than its 2 cores), with ENV_B= to change nothing else.
# SERVE_FLAGS: the services' flags (default --rebalance-period=10; --rebalance-period=0 keeps both on their first split,
# so a change that moves the head's CPU is not also a change of split).
# Usage: RAYCLUSTER_LAB_NAME=rc-ex RAYCLUSTER_LAB_SUBNET=10.91.0.0/24 [RAYCLUSTER_NODE_IMAGE=...] [ENV_B=...] \
#        [SERVE_FLAGS=...] benchmarks/serve_env_ab.sh [ROUNDS] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
OUT=${2:-/tmp/serve-env-ab}
PYTHON=${PYTHON:-.venv/bin/python}
ENV_B=${ENV_B-RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE=1000 RAY_SERVE_LOG_TO_STDERR=0}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
R="$PYTHON -m raycluster_cli"
source benchmarks/serve_lab3.sh
BASE=$LAB_INVENTORY
for round in $(seq 0 $((ROUNDS - 1))); do
  for cfg in A B; do
    INV=$OUT/inv-$cfg.yaml
    cp "$BASE" "$INV"
    if [ $cfg = B ]; then
      if [ -n "$ENV_B" ]; then echo "env:" >> "$INV"; fi
      for pair in $ENV_B; do echo "  ${pair%%=*}: \"${pair#*=}\"" >> "$INV"; done
      if [ -n "${QUOTAS_B:-}" ]; then
        $PYTHON - "$INV" "$QUOTAS_B" <<'PY'
import sys
from pathlib import Path
import yaml
from raycluster_cli.lab.hosts import quota_options
path, spec = Path(sys.argv[1]), sys.argv[2]
data = yaml.safe_load(path.read_text())
options = quota_options(spec, len(data["hosts"]))
for index, host in enumerate(data["hosts"], start=1):  # the lab's hosts in order: lab-h1, lab-h2, ...
    host.setdefault("docker", {})["run_options"] = options[f"lab-h{index}"]
path.write_text(yaml.safe_dump(data, sort_keys=False))
PY
      fi
    fi
    timeout 600 $R down -i "$INV" --json > /dev/null || true
    timeout 1200 $R up -i "$INV" --json > "$OUT/up-$round-$cfg.json"
    timeout 1200 $R serve --model-path="$MODEL" --max-seq=256 --slots=16 ${SERVE_FLAGS:---rebalance-period=10} -i "$INV" --json \
      > "$OUT/serve-$round-$cfg.json"
    B="timeout 900 $R bench --serve --rates= -i $INV --json"
    for warm in 0 1; do $B --requests=64 --prompt-tokens=16:64 --output-tokens=32:96 > "$OUT/warm-$round-$cfg-$warm.json"; done
    for c in 1 4 32; do
      f="$OUT/$round-$cfg-c$c.json"
      $B --prompt-tokens=16:64 --output-tokens=32:96 --requests=$((c == 1 ? 8 : 32)) --concurrency=$c > "$f"
      $PYTHON - "$f" "$round $cfg c$c" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); r = d["runs"][0]; a = list(r["anatomy"].values())[-1]
print(sys.argv[2], round(r["output_tokens_per_s"], 1), "tok/s, TPOT p50", round(r["latency_s"]["tpot"]["p50"] * 1000, 1),
      "ms, round trip", a["round_trip_ms"], "in flight", a["in_flight"], "compute", [s["compute_ms"] for s in a["stages"]],
      "links", [s["link_ms"] for s in a["stages"]], a["return_link_ms"], "lag", a["loop_lag_ms"],
      "blocks", [s["blocks"] for s in r["stages"]], "node cpu/quota", [s.get("node_cpu_share") for s in r["stages"]],
      "front end ms/token", [(r.get("front_end") or {}).get(f"{p}_ms_per_token") for p in ("ingress", "proxy")], flush=True)
PY
    done
    $R serve --stop -i "$INV" --json > /dev/null
  done
done
