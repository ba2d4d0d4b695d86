#!/usr/bin/env bash
# Even vs balanced partition on the local 3-host lab, alternated, medians reported.
# Usage: benchmarks/partition_even_vs_balanced.sh [ROUNDS] [extra `lab up` args, e.g. --cpus lab-h2=0.25]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}; shift || true
rc=.venv/bin/raycluster
inv=$($rc lab up --hosts 3 "$@" --json 2>/dev/null | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["inventory"])')
$rc up -i "$inv" --json >/dev/null
out=$(mktemp -d)
for i in $(seq 1 "$rounds"); do
  for p in even balanced; do
    $rc bench -i "$inv" --partition "$p" --layers 24 --json >"$out/$p-$i.json" 2>/dev/null
  done
done
$rc down -i "$inv" --json >/dev/null
.venv/bin/python - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
res = {p: [json.load(open(f"{out}/{p}-{i}.json")) for i in range(1, rounds + 1)] for p in ("even", "balanced")}
med = lambda p, k: statistics.median(d[k] for d in res[p])
for p in ("even", "balanced"):
    layers = [s["layers"] for s in res[p][0]["stages"]]
    print(f"{p:9s} layers={layers} tokens/s={med(p, 'tokens_per_s'):.1f} imbalance={med(p, 'imbalance'):.3f}")
print(f"balanced/even tokens/s ratio (medians): {med('balanced', 'tokens_per_s') / med('even', 'tokens_per_s'):.2f}")
PY
