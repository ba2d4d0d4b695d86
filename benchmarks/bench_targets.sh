#!/usr/bin/env bash
# Issue 12's targets: the *default* `raycluster bench` (no tuning flags) on the local 3-host lab with
# unequal hosts (CPU quotas 1.0/0.25/0.25), equal hosts (0.6 each) and the demo's lab (1.0/0.5/0.25),
# alternated round by round, the load average recorded before and after each run, medians reported.
#
# Usage: benchmarks/bench_targets.sh [ROUNDS]   (default 3; OUT=dir keeps every JSON result; CONFIGS below)
# Environment: RAYCLUSTER_LAB_NAME / RAYCLUSTER_LAB_SUBNET / RAYCLUSTER_NODE_IMAGE as for the lab.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
. benchmarks/lab_with_quotas.sh
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
# CONFIGS="unequal:1.0,0.25,0.25 equal:0.6,0.6,0.6" runs a subset (NAME:QUOTAS, space-separated)
read -r -a configs <<<"${CONFIGS:-unequal:1.0,0.25,0.25 equal:0.6,0.6,0.6 demo:1.0,0.5,0.25}"
echo "default bench, ${configs[*]}, $rounds alternated rounds, results in $out" >&2
for i in $(seq 1 "$rounds"); do
  for config in "${configs[@]}"; do
    name=${config%%:*}
    lab_with_quotas "${config#*:}"
    cut -d' ' -f1-3 /proc/loadavg >"$out/$name-$i.load-before"
    rc bench -i "$inv" --json >"$out/$name-$i.json" || true
    cut -d' ' -f1-3 /proc/loadavg >"$out/$name-$i.load-after"
  done
done
rc down -i "$inv" --json >/dev/null
"$py" benchmarks/bench_targets_summary.py "$out"
