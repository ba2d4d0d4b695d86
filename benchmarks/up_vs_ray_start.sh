#!/usr/bin/env bash
# `raycluster up` on the local 3-host lab vs a bare `ray start --head` + one worker `ray start`, alternated,
# medians reported. Both start from no Ray container; the image is already on every lab host (as it is
# for a re-deploy). The bare variant is what one would type by hand: `docker run … ray start --head` on
# lab-h1, wait for its GCS, `docker run … ray start --address` on lab-h2, wait until 2 nodes are alive
# (no preflight checks, no token, no per-host env, one worker instead of two).
# Usage: benchmarks/up_vs_ray_start.sh [ROUNDS]   (env: RAYCLUSTER_LAB_NAME, RAYCLUSTER_NODE_IMAGE, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
py=${PYTHON:-.venv/bin/python}
rc="$py -m raycluster_cli.cli"
docker=$(command -v /usr/bin/docker || command -v docker)
lab=${RAYCLUSTER_LAB_NAME:-raycluster-lab}
image=${RAYCLUSTER_NODE_IMAGE:-raycluster/node:0.1.0}
inv=$($rc lab up --hosts 3 --json 2>/dev/null | $py -c 'import json,sys; print(json.load(sys.stdin)["inventory"])')
ip() { $py -c "import yaml,sys; print(yaml.safe_load(open('$inv'))['hosts'][$1]['address'])"; }
ip1=$(ip 0); ip2=$(ip 1)
now() { date +%s%N; }
elapsed() { echo "$(( ($(now) - $1) / 1000000 ))"; }  # milliseconds since $1
bare_clean() {
  $docker exec "$lab-h1" docker rm -f bare-head >/dev/null 2>&1 || true
  $docker exec "$lab-h2" docker rm -f bare-worker >/dev/null 2>&1 || true
}
bare() {
  local t0; t0=$(now)
  $docker exec "$lab-h1" docker run -d --name bare-head --network host --shm-size 1g "$image" \
    ray start --head --port=6379 --node-ip-address="$ip1" --dashboard-host="$ip1" \
    --object-store-memory=300000000 --block >/dev/null
  until $docker exec "$lab-h1" docker exec bare-head ray health-check --address "$ip1:6379" >/dev/null 2>&1; do
    sleep 0.5
  done
  $docker exec "$lab-h2" docker run -d --name bare-worker --network host --shm-size 1g "$image" \
    ray start --address="$ip1:6379" --node-ip-address="$ip2" --object-store-memory=300000000 --block >/dev/null
  $docker exec "$lab-h1" docker exec bare-head python -m raycluster_cli.probe --address "$ip1:6379" \
    --expect "$ip1,$ip2" --timeout 300 >/dev/null
  elapsed "$t0"
}
up() {
  local t0; t0=$(now)
  $rc up -i "$inv" --json >/dev/null 2>&1
  elapsed "$t0"
}
out=$(mktemp -d)
$rc down -i "$inv" --json >/dev/null 2>&1; bare_clean
$rc up -i "$inv" --json >/dev/null 2>&1  # first up: token, env files (what every later deploy finds)
for i in $(seq 1 "$rounds"); do
  $rc down -i "$inv" --json >/dev/null 2>&1
  up >>"$out/up"
  $rc down -i "$inv" --json >/dev/null 2>&1
  bare >>"$out/bare"; bare_clean
done
$py - "$out" <<'PY'
import statistics, sys
out = sys.argv[1]
times = {k: [int(x) / 1000 for x in open(f"{out}/{k}").read().split()] for k in ("up", "bare")}
for k, v in times.items():
    print(f"{k:5s} runs={' '.join(f'{x:.1f}' for x in v)} median={statistics.median(v):.1f}s")
print(f"up / bare (medians): {statistics.median(times['up']) / statistics.median(times['bare']):.2f}")
PY
