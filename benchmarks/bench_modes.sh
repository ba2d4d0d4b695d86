#!/usr/bin/env bash
# bench's other modes on the local 3-host lab: micro-batch sweep, node sweep, Poisson load and
# 3 replicas of a 1-stage pipeline (power-of-two-choices routing).  One run each, summarised.
#
# Usage: benchmarks/bench_modes.sh [QUOTAS] [extra bench flags...]   (QUOTAS default 0.6,0.6,0.6)
set -euo pipefail
cd "$(dirname "$0")/.."
quotas=${1:-0.6,0.6,0.6}
shift || true
. benchmarks/lab_with_quotas.sh
lab_with_quotas "$quotas"
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
base=(--layers 24 --requests 32 --max-new-tokens 16 "$@")
rc bench -i "$inv" "${base[@]}" --no-references --sweep batch --json >"$out/sweep-batch.json"
rc bench -i "$inv" "${base[@]}" --no-references --sweep nodes --json >"$out/sweep-nodes.json"
rc bench -i "$inv" "${base[@]}" --no-references --rate 3 --json >"$out/rate-3.json"
rc bench -i "$inv" "${base[@]}" --stages 1 --no-references --json >"$out/replicas.json"
rc down -i "$inv" --json >/dev/null
"$py" - "$out" "$quotas" <<'PY'
import json, sys
out, quotas = sys.argv[1], sys.argv[2]
load = lambda name: json.load(open(f"{out}/{name}.json"))
p50 = lambda lat, k: lat[k]["p50"]
print(f"quotas {quotas}")
d = load("sweep-batch")
for p in d["sweep"]["points"]:
    print(f"  micro-batch {p['micro_batch']:3d}: {p['tokens_per_s']:7.1f} tok/s, TTFT p50 {p50(p['latency_s'], 'ttft'):.3f}s,"
          f" TPOT p50 {p50(p['latency_s'], 'tpot'):.3f}s, e2e p50 {p50(p['latency_s'], 'e2e'):.3f}s")
print(f"  best micro-batch: {d['sweep']['best_micro_batch']}")
d = load("sweep-nodes")
for p in d["sweep"]["points"]:
    print(f"  {p['nodes']} node(s): {p['tokens_per_s']:7.1f} tok/s, efficiency vs linear {p['efficiency']:.2f}, imbalance {p['imbalance']:.3f}")
d = load("rate-3")
lat = d["latency_s"]
print(f"  Poisson 3 req/s: {d['tokens_per_s']:.1f} tok/s, TTFT p50/p90/p99 "
      f"{lat['ttft']['p50']:.3f}/{lat['ttft']['p90']:.3f}/{lat['ttft']['p99']:.3f}s, TPOT p50 {lat['tpot']['p50']:.3f}s")
d = load("replicas")
print(f"  3 replicas x 1 stage: {d['tokens_per_s']:.1f} tok/s; load per replica "
      + ", ".join(f"{r['hosts'][0]} {r['requests']} req" for r in d["replicas"]))
PY
