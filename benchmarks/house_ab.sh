#!/usr/bin/env bash
# Before/after a refactor that must not change figures: two trees (A, B), each with its own CLI and node image,
# alternated on the 3-host lab (CPU quotas 1.0 / 0.5 / 0.25). Per round and tree: the cluster down and up with that
# tree's image, the default `bench` (tokens/s of the balanced split; the even split and one node beside it), then
# `serve` (tiny-chat shape of serve_targets.py) and `bench --serve` at 1, 4 and 32 at once; one line per figure.
# BENCH_FLAGS: the bench's flags (e.g. --layers=240, so both trees run the same model whatever their calibration).
# ORDER: the order within a round (default "A B"; "B A" to see whether the second one pays for going second).
# Usage: TREE_A=/path IMAGE_A=tag TREE_B=/path IMAGE_B=tag [BENCH_FLAGS=...] benchmarks/house_ab.sh [ROUNDS] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-1}
OUT=${2:-/tmp/house-ab}
PYTHON=${PYTHON:-$PWD/.venv/bin/python}
mkdir -p "$OUT"
R="$PYTHON -m raycluster_cli"
source benchmarks/serve_lab3.sh
for round in $(seq 0 $((ROUNDS - 1))); do
  for cfg in ${ORDER:-A B}; do
    tree_var=TREE_$cfg image_var=IMAGE_$cfg
    tree=${!tree_var} image=${!image_var}
    INV=$OUT/inv-$cfg.yaml
    sed "s|^image: .*|image: $image|" "$LAB_INVENTORY" > "$INV"
    run() { (cd "$tree" && PYTHONPATH=$tree timeout "$1" $PYTHON -m raycluster_cli "${@:2}"); }
    run 600 down -i "$INV" --json > /dev/null || true
    run 1200 up -i "$INV" --json > "$OUT/up-$round-$cfg.json"
    run 1800 bench -i "$INV" --json ${BENCH_FLAGS:-} > "$OUT/bench-$round-$cfg.json" || true
    $PYTHON - "$OUT/bench-$round-$cfg.json" "$round $cfg bench" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
m = d if "tokens_per_s" in d else d.get("main", {})
refs = {k: round(v["ratio"], 3) for k, v in (d.get("references") or {}).items() if isinstance(v, dict) and v.get("ratio")}
print(sys.argv[2], "tok/s", round(m.get("tokens_per_s", 0), 1), "imbalance", m.get("imbalance"), "ratios", refs,
      "ok", d.get("ok"), flush=True)
PY
    run 1200 serve --model-path="$MODEL" --max-seq=256 --slots=16 --rebalance-period=0 -i "$INV" --json > "$OUT/serve-$round-$cfg.json"
    run 900 bench --serve --rates= -i "$INV" --json --requests=32 --prompt-tokens=16:64 --output-tokens=32:96 > "$OUT/warm-$round-$cfg.json"
    run 300 status -i "$INV" --json > "$OUT/status-$round-$cfg.json" || true  # each stage's product forms (matmuls)
    for c in 1 4 32; do
      f="$OUT/$round-$cfg-c$c.json"
      run 900 bench --serve --rates= -i "$INV" --json --prompt-tokens=16:64 --output-tokens=32:96 \
        --requests=$((c == 1 ? 8 : 32)) --concurrency=$c > "$f"
      $PYTHON - "$f" "$round $cfg serve c$c" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["runs"][0]
print(sys.argv[2], round(r["output_tokens_per_s"], 1), "tok/s, TPOT p50", round(r["latency_s"]["tpot"]["p50"] * 1000, 1), "ms",
      "failed", r["failed"], flush=True)
PY
    done
    run 600 serve --stop -i "$INV" --json > /dev/null
  done
done
