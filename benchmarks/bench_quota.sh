#!/usr/bin/env bash
# The issue-5 benchmark on the local 3-host lab: per-host CPU quotas, balanced split with its
# same-run references (even split, unsharded model, pipeline ceiling), repeated, medians reported.
#
# Usage: benchmarks/bench_quota.sh QUOTAS [ROUNDS] [extra bench flags...]
#   QUOTAS  per-host --cpus of the Ray containers, e.g. 0.6,0.6,0.6 (equal) or 1.0,0.25,0.25 (unequal)
#   ROUNDS  repeats (default 3)
# Environment: RAYCLUSTER_LAB_NAME / RAYCLUSTER_LAB_SUBNET / RAYCLUSTER_NODE_IMAGE as for the lab;
# OUT=dir keeps every JSON result (default: a temp dir, printed).
# Example: benchmarks/bench_quota.sh 1.0,0.25,0.25 3   (summary: benchmarks/bench_summary.py DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
quotas=${1:?usage: $0 QUOTAS [ROUNDS] [bench flags...]}
rounds=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
. benchmarks/lab_with_quotas.sh
lab_with_quotas "$quotas"
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
flags=(--layers 192 --requests 64 --max-new-tokens 16 --micro-batch 8 --prefill-chunk 8 "$@")
echo "quotas $quotas, $rounds rounds, bench ${flags[*]}, results in $out" >&2
for i in $(seq 1 "$rounds"); do
  cut -d' ' -f1-3 /proc/loadavg >"$out/load-$i.before"
  rc bench -i "$inv" --partition balanced "${flags[@]}" --json >"$out/round-$i.json"
  cut -d' ' -f1-3 /proc/loadavg >"$out/load-$i.after"
done
rc down -i "$inv" --json >/dev/null
"$py" benchmarks/bench_summary.py "$out" "quotas $quotas"
