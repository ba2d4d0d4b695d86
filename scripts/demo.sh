#!/usr/bin/env bash
# `make demo`: a 3-host lab whose hosts are unequal (CPU quotas of their Ray containers), then doctor → up →
# a short bench → serve → a chat request → next steps (→ serve --stop, down, unless KEEP=1). The bench's report
# shows what balancing buys there: the balanced split next to the even split and the whole model unsharded on one
# node, its output checked. Then a tiny chat checkpoint written here (a random Llama with a real tokenizer) is
# served across the hosts and answers the `openai` client with the service's own key; the demo fails if it does not.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
QUOTAS=${DEMO_QUOTAS:-1.0,0.5,0.25}
HOSTS=${LAB_HOSTS:-3}
# A first look: a smaller model and a shorter counted run than bench's defaults (which are sized for stable
# figures, about 7 minutes here). The same comparison, measured in about 2 minutes.
DEMO_BENCH=${DEMO_BENCH:---min-blocks-per-node 16 --duration-s 6 --refine 1 --calibration-repeats 3 --dtype float32 --check-output}
# The service's flags: a tiny model's short context and few slots keep its deployment quick on the lab.
DEMO_SERVE=${DEMO_SERVE:---max-seq 128 --slots 4}
KEEP=${KEEP:-0}
work=$(mktemp -d /tmp/raycluster-demo.XXXXXX)
trap 'rm -rf "$work"' EXIT

inv=$("$BIN/raycluster" lab up --hosts "$HOSTS" --cpu-quotas "$QUOTAS" --json \
  | "$BIN/python" -c 'import json,sys; print(json.load(sys.stdin)["inventory"])')
rc() { echo "== raycluster $*"; "$BIN/raycluster" "$@"; }
rc doctor -i "$inv"
rc up -i "$inv"
echo "   (the short demo run; the full benchmark: $BIN/raycluster bench -i $inv --check-output)"
# shellcheck disable=SC2086  # DEMO_BENCH is a list of flags
rc bench -i "$inv" $DEMO_BENCH --save-result "${DEMO_RESULT:-/tmp/raycluster-demo-bench.json}"

model="$work/tiny-chat"
echo "== a tiny chat checkpoint written here: $BIN/python -m raycluster_cli.models.tiny_chat $model"
"$BIN/python" -m raycluster_cli.models.tiny_chat "$model"
echo "== raycluster serve -i $inv --model-path $model $DEMO_SERVE --json"
# shellcheck disable=SC2086  # DEMO_SERVE is a list of flags
"$BIN/raycluster" serve -i "$inv" --model-path "$model" $DEMO_SERVE --json >"$work/serve.json"
echo "== a chat request: the openai client with the service's own key (scripts/demo_chat.py)"
"$BIN/python" scripts/demo_chat.py "$work/serve.json"

if [ "$KEEP" = 1 ]; then state="still up"; else state="removed now; make demo KEEP=1 keeps it up"; fi
cat <<NEXT

== Next steps (the cluster is $state)
  $BIN/raycluster status -i $inv                    # each node: container, Ray node, resources, image
  $BIN/raycluster exec -i $inv -- ray status        # any command in the head's Ray container
  $BIN/raycluster exec -i $inv --all -- nproc       # ... or on every node at once
  $BIN/raycluster submit -i $inv -- python -c 'import ray; ray.init(); print(ray.cluster_resources())'
  $BIN/raycluster dashboard -i $inv                 # Ray's dashboard at http://127.0.0.1:8265 (Ctrl-C ends it)
  $BIN/raycluster bench -i $inv --check-output      # the full benchmark (about 7 minutes here)
  $BIN/raycluster serve -i $inv --model-path DIR    # a Hugging Face checkpoint as an OpenAI-compatible API
  $BIN/raycluster serve -i $inv --stop              # remove the service (the demo's tiny-chat, while it runs)
  $BIN/raycluster down -i $inv                      # remove the cluster;  $BIN/raycluster lab down: the lab
NEXT
if [ "$KEEP" != 1 ]; then
  rc serve -i "$inv" --stop
  rc down -i "$inv"
fi
