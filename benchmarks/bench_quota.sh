#!/usr/bin/env bash
# The issue-5 benchmark on the local 3-host lab: per-host CPU quotas, balanced split with its
# same-run references (even split, unsharded model, pipeline ceiling), repeated, medians reported.
#
# Usage: benchmarks/bench_quota.sh QUOTAS [ROUNDS] [extra bench flags...]
#   QUOTAS  per-host --cpus of the Ray containers, e.g. 0.6,0.6,0.6 (equal) or 1.0,0.25,0.25 (unequal)
#   ROUNDS  repeats (default 3)
# Environment: RAYCLUSTER_LAB_NAME / RAYCLUSTER_LAB_SUBNET / RAYCLUSTER_NODE_IMAGE as for the lab;
# OUT=dir keeps every JSON result (default: a temp dir, printed).
# Example: benchmarks/bench_quota.sh 1.0,0.25,0.25 3 --layers 48
set -euo pipefail
cd "$(dirname "$0")/.."
quotas=${1:?usage: $0 QUOTAS [ROUNDS] [bench flags...]}
rounds=${2:-3}
shift $(( $# >= 2 ? 2 : 1 ))
py=${PYTHON:-python}
rc() { "$py" -m raycluster_cli.cli "$@"; }
IFS=, read -r -a q <<<"$quotas"
cpus=()
for i in "${!q[@]}"; do cpus+=(--cpus "lab-h$((i + 1))=${q[$i]}"); done
inv=$(rc lab up --hosts "${#q[@]}" "${cpus[@]}" --json 2>/dev/null | "$py" -c 'import json,sys; print(json.load(sys.stdin)["inventory"])')
rc down -i "$inv" --json >/dev/null   # a running cluster keeps its old quotas: start afresh
rc up -i "$inv" --json >/dev/null
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
flags=(--layers 48 --requests 32 --max-new-tokens 16 --micro-batch 4 "$@")
echo "quotas $quotas, $rounds rounds, bench ${flags[*]}, results in $out" >&2
for i in $(seq 1 "$rounds"); do
  rc bench -i "$inv" --partition balanced "${flags[@]}" --json >"$out/round-$i.json"
done
rc down -i "$inv" --json >/dev/null
"$py" - "$out" "$rounds" "$quotas" <<'PY'
import json, statistics, sys
out, rounds, quotas = sys.argv[1], int(sys.argv[2]), sys.argv[3]
docs = [json.load(open(f"{out}/round-{i}.json")) for i in range(1, rounds + 1)]
med = lambda f: statistics.median(f(d) for d in docs)
refs = lambda d, name, key: d["references"][name][key]
print(f"quotas {quotas}: {rounds} rounds, medians")
print(f"  balanced layers (round 1): {[s['layers'] for s in docs[0]['stages']]}  "
      f"even layers: {[b - a for a, b in docs[0]['references']['even']['partition_ranges']]}")
print(f"  balanced tokens/s {med(lambda d: d['tokens_per_s']):.1f}, imbalance {med(lambda d: d['imbalance']):.3f}, "
      f"utilisation {med(lambda d: d['utilisation']):.2f}")
print(f"  even     tokens/s {med(lambda d: refs(d, 'even', 'tokens_per_s')):.1f}, "
      f"imbalance {med(lambda d: refs(d, 'even', 'imbalance')):.3f}")
print(f"  balanced/even {med(lambda d: refs(d, 'even', 'ratio')):.2f}x, "
      f"balanced/unsharded {med(lambda d: refs(d, 'unsharded', 'ratio')):.2f}x, "
      f"balanced/ceiling {med(lambda d: refs(d, 'ceiling', 'ratio')):.2f}x")
print(f"  per-hop overhead {1000 * med(lambda d: d['hop_overhead']['per_hop_s']):.2f} ms; "
      f"T_max-T_min {med(lambda d: d['t_max_minus_t_min_s']):.3f} s")
for d in docs:
    print("  round:", [f"{s['host']} {s['layers']}L busy {s['busy_s']:.2f}s pred {s['predicted_s']:.2f}s"
                       for s in d["stages"]], f"imb {d['imbalance']:.3f}", f"x-even {refs(d, 'even', 'ratio'):.2f}")
PY
