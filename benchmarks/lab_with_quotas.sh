# Sourced by the bench scripts: `rc` runs the CLI, `lab_with_quotas QUOTAS` brings the lab up with
# one Ray-container CPU quota per host (e.g. 0.6,0.6,0.6), starts the cluster afresh (a running
# cluster keeps its old quotas) and sets `inv` to the lab's inventory.
py=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}  # the project's venv (make venv) when there is one
rc() { "$py" -m raycluster_cli.cli "$@"; }
lab_with_quotas() {
  local q i
  local -a cpus=()
  IFS=, read -r -a q <<<"$1"
  for i in "${!q[@]}"; do cpus+=(--cpus "lab-h$((i + 1))=${q[$i]}"); done
  inv=$(rc lab up --hosts "${#q[@]}" "${cpus[@]}" --json 2>/dev/null | "$py" -c 'import json,sys; print(json.load(sys.stdin)["inventory"])')
  rc down -i "$inv" --json >/dev/null
  rc up -i "$inv" --json >/dev/null
}
