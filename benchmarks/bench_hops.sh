#!/usr/bin/env bash
# Per-hop overhead of the pipeline with no-op stages (what a stage boundary costs without compute):
# `bench` measures it in every run (hop_overhead: a decode step's and a prefill piece's activation sent
# through each stage's no-op `hop`, median of round trips / stages), both ways in the same run, alternated:
# stage to stage (each stage calls the next, the default) and via the driver (the driver chains the calls).
# This repeats a short run ROUNDS times on the local 3-host lab (no quotas) and reports the medians and the
# ratio via-driver / stage-to-stage, with the load average of each round.
#
# Usage: benchmarks/bench_hops.sh [ROUNDS]   (default 5)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
. benchmarks/lab_with_quotas.sh
lab_with_quotas 1.0,1.0,1.0
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
for i in $(seq 1 "$rounds"); do
  cut -d' ' -f1-3 /proc/loadavg >"$out/hops-$i.load"
  rc bench -i "$inv" --quick --layers 3 --partition even --refine 0 --no-references --no-network-check --json \
    >"$out/hops-$i.json"
done
rc down -i "$inv" --json >/dev/null
"$py" - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
docs = [json.load(open(f"{out}/hops-{i}.json")) for i in range(1, rounds + 1)]
loads = [open(f"{out}/hops-{i}.load").read().strip() for i in range(1, rounds + 1)]
for kind in ("decode", "prefill"):
    size = docs[0]["hop_overhead"][kind]["payload_bytes"]
    for way, key in (("stage to stage", "per_hop_direct_s"), ("via the driver", "per_hop_via_driver_s")):
        ms = [1000 * d["hop_overhead"][kind][key] for d in docs]
        print(f"{kind:7s} ({size} bytes) {way}: per hop {' '.join(f'{m:.2f}' for m in ms)} ms, median {statistics.median(ms):.2f} ms")
    ratios = [d["hop_overhead"][kind]["via_driver_over_direct"] for d in docs]
    print(f"{kind:7s} via the driver / stage to stage, per round: {' '.join(f'{r:.2f}' for r in ratios)}, median {statistics.median(ratios):.2f}")
print("load averages: " + " | ".join(loads))
PY
