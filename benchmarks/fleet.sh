#!/usr/bin/env bash
# Fleet benchmark (issue 11), one run, every figure against a reference measured in the same run:
#  1. doctor / status / down on 1, 10 and 30 hosts (no node image, no cluster) against the parallel-ssh
#     floor: one plain `ssh` per host, all at once, running a comparable bundle of read-only commands;
#  2. remote commands per host per verb, counted from sshd's own log on each lab host
#     ("Starting session: command" lines at LogLevel VERBOSE in `docker logs <host>`);
#  3. image distribution to P2P_HOSTS hosts that lack the image: bytes the operator sent (the lab bridge's
#     tx_bytes, independent of the program) and wall time, peer-to-peer vs operator-only streaming;
#  4. `up` of RAY_NODES Ray nodes (num_cpus 1 each) until all are alive, then `down`.
# Every figure is printed with the 1-minute load average when it was taken.
#
# Usage: benchmarks/fleet.sh            (ROUNDS=3 SIZES="1 10 30" P2P_HOSTS=8 RAY_NODES=8)
#        ROUNDS=1 SIZES="1 3" P2P_HOSTS=2 RAY_NODES=0 IMAGE=<small image> benchmarks/fleet.sh   (smoke run)
#        SIZES= RAY_NODES=0 benchmarks/fleet.sh   (only the image distribution; P2P_HOSTS=0: skip it)
# Env: LAB (lab name, default "$RAYCLUSTER_LAB_NAME-bench"), SUBNET (default 10.80.0.0/24), HOSTS (lab size, at
# least the largest N), IMAGE (the node image, default $RAYCLUSTER_NODE_IMAGE), KEEP=1 keeps the lab afterwards,
# BASELINE (a folder holding another checkout, e.g. `git worktree add /tmp/base main`): section 1 also times that
# code's verbs ("doctor@base" …), alternated with this checkout's in every round, against the same floor.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(realpath -s "${PYTHON:-.venv/bin/python}")  # absolute: base() runs it from the BASELINE folder
ROUNDS=${ROUNDS:-3}
SIZES=${SIZES-1 10 30}
P2P_HOSTS=${P2P_HOSTS:-8}
RAY_NODES=${RAY_NODES:-8}
LAB=${LAB:-${RAYCLUSTER_LAB_NAME:-raycluster-lab}-bench}
SUBNET=${SUBNET:-10.80.0.0/24}
IMAGE=${IMAGE:-${RAYCLUSTER_NODE_IMAGE:-raycluster/node:0.1.0}}
DOCKER=$(command -v /usr/bin/docker || command -v docker)
out=$(mktemp -d /tmp/raycluster-fleet.XXXXXX)
# Each checkout as its `raycluster` command runs it: `python -m raycluster_cli` where the package has a __main__
# (logins started before the CLI's imports, cli/entry.py), else (older commits) `python -m raycluster_cli.cli`.
entry() { if [ -e "$1/raycluster_cli/__main__.py" ]; then echo raycluster_cli; else echo raycluster_cli.cli; fi; }
rc() { "$py" -m "$(entry .)" "$@"; }
base() { (cd "$BASELINE" && "$py" -m "$(entry .)" "$@"); }  # -m finds the checkout in the current folder
load() { cut -d' ' -f1 /proc/loadavg; }
max=${HOSTS:-0}; for n in $SIZES $P2P_HOSTS $RAY_NODES; do [ "$n" -gt "$max" ] && max=$n; done
echo "# fleet benchmark $(date -u +%FT%TZ) on $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB; lab $LAB ($max hosts); results in $out"

# Bytecode as an installed CLI has it (pip compiles at install): with PYTHONDONTWRITEBYTECODE set (as in this
# project's sessions) every start of a source checkout would compile its ~50 modules again.
"$py" -m compileall -q raycluster_cli ${BASELINE:+"$BASELINE/raycluster_cli"} >/dev/null
rc lab up --hosts "$max" --name "$LAB" --subnet "$SUBNET" --no-node-image --json >"$out/lab.json" 2>"$out/lab.log"
"$py" benchmarks/fleet_inventories.py "$out/lab.json" "$out" $SIZES "p2p:$P2P_HOSTS" "ray:$RAY_NODES" "$IMAGE"
mapfile -t names < <("$py" -c 'import json,sys; [print(h["name"]) for h in json.load(open(sys.argv[1]))["hosts"]]' "$out/lab.json")
key=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["lab_dir"])' "$out/lab.json")/id_ed25519
known=$(dirname "$key")/known_hosts
bridge=/sys/class/net/br-$("$DOCKER" network inspect -f '{{.Id}}' "$LAB" | cut -c1-12)/statistics/tx_bytes

sessions() {  # total remote commands so far on the first $1 hosts, one number per host
  local i
  for ((i = 0; i < $1; i++)); do "$DOCKER" logs "${names[$i]}" 2>&1 | grep -c 'Starting session: command' || true; done
}
floor() {  # one plain ssh per host, all at once, a bundle of read-only commands like doctor's
  local inv=$1 ip
  for ip in $("$py" -c 'import sys,yaml; [print(h["address"]) for h in yaml.safe_load(open(sys.argv[1]))["hosts"]]' "$inv"); do
    ssh -i "$key" -o UserKnownHostsFile="$known" -o StrictHostKeyChecking=yes -o BatchMode=yes -o ConnectTimeout=10 \
      "root@$ip" 'docker info --format "{{.ServerVersion}}"; docker image inspect --format "{{.Id}}" '"$IMAGE"'; \
      ip -o -4 addr; ip route get 10.0.0.1; cat /etc/hosts; df -P /var/lib/docker /tmp; head -5 /proc/meminfo; \
      ss -ltn; date +%s.%N; ps -eo comm; docker ps -a --format "{{.Names}}"; nproc' >/dev/null 2>&1 &
  done
  wait
}
timed() {  # timed NAME CMD...: seconds of CMD (its exit status ignored: doctor fails without the image)
  local t0 t1
  t0=$(date +%s.%N); "$@" >/dev/null 2>&1 || true; t1=$(date +%s.%N)
  echo "$1 $(echo "$t1 - $t0" | bc)"
}

echo
echo "## 1. doctor / status / down vs the parallel-ssh floor (seconds, median of $ROUNDS rounds)"
for n in $SIZES; do
  inv=$out/hosts-$n.yaml
  for ((r = 1; r <= ROUNDS; r++)); do
    { echo "floor $(timed floor "$inv" | cut -d' ' -f2) $(load)"
      for verb in doctor status down; do
        runs="rc"; [ -z "${BASELINE:-}" ] || { ((r % 2)) && runs="rc base" || runs="base rc"; }
        for how in $runs; do
          echo "$verb$([ "$how" = base ] && echo @base) $(timed "$how" "$verb" -i "$inv" --json | cut -d' ' -f2) $(load)"
        done
      done
    } >>"$out/times-$n.txt"
  done
  "$py" benchmarks/fleet_summary.py times "$n" "$out/times-$n.txt"
done

echo
echo "## 2. remote commands per host per verb (sshd's log; min / max over the hosts)"
n=$(echo "$SIZES" | tr ' ' '\n' | sort -n | tail -1)
for verb in ${n:+doctor status down}; do
  before=$(sessions "$n" | tr '\n' ' ')
  rc "$verb" -i "$out/hosts-$n.yaml" --json >/dev/null 2>&1 || true
  after=$(sessions "$n" | tr '\n' ' ')
  "$py" benchmarks/fleet_summary.py commands "$verb" "$before" "$after"
done

echo
echo "## 3. image distribution of $IMAGE to $P2P_HOSTS hosts that lack it"
if [ "$P2P_HOSTS" -gt 0 ]; then
  for mode in operator peers ${BASELINE:+peers@base}; do
    for ((i = 0; i < P2P_HOSTS; i++)); do
      "$DOCKER" exec "${names[$i]}" sh -c "docker rmi -f $IMAGE >/dev/null 2>&1; rm -rf /var/tmp/raycluster-images; true"
    done
    # peers@base: this script's driver with the BASELINE checkout's package (PYTHONPATH comes first)
    PYTHONPATH=$([ "$mode" = peers@base ] && realpath "$BASELINE" || true) \
      "$py" benchmarks/fleet_distribute.py "$out/p2p.yaml" "${mode%@base}" "$bridge" "$out/archives" \
      | sed "s/^peers:/$mode:/" >"$out/p2p-$mode.txt"
    cat "$out/p2p-$mode.txt" >>"$out/p2p.txt"
    sed "\$s/\$/ load=$(load)/" "$out/p2p-$mode.txt"  # the summary last, after any fallback's reason
  done
fi

echo
echo "## 4. up of $RAY_NODES Ray nodes (num_cpus 1 each) until all alive"
if [ "$RAY_NODES" -gt 0 ]; then
  echo "free memory before: $(free -g | awk '/Mem:/{print $7}') GiB available"
  rc down -i "$out/ray.yaml" --json >/dev/null 2>&1 || true
  for again in "" " again (every container kept)"; do
    before=$(sessions "$RAY_NODES" | tr '\n' ' ')
    t0=$(date +%s.%N)
    log=$out/up${again:+-again}
    if rc up -i "$out/ray.yaml" --json >"$log.json" 2>"$log.log"; then status=ok; else status="failed (see $log.log)"; fi
    t1=$(date +%s.%N)
    after=$(sessions "$RAY_NODES" | tr '\n' ' ')
    alive=$("$py" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sum(1 for n in d.get("nodes", []) if n.get("alive", True)))' "$log.json" 2>/dev/null || echo "?")
    echo "up $RAY_NODES nodes$again: $(echo "$t1 - $t0" | bc) s, $status, nodes reported: $alive, load=$(load)"
    "$py" benchmarks/fleet_summary.py commands "up$again" "$before" "$after"
  done
  t0=$(date +%s.%N); rc down -i "$out/ray.yaml" --json >/dev/null 2>&1 || true; t1=$(date +%s.%N)
  echo "down $RAY_NODES nodes: $(echo "$t1 - $t0" | bc) s, load=$(load)"
fi

[ "${KEEP:-0}" = 1 ] || rc lab down --name "$LAB" --keep-volumes --json >/dev/null 2>&1
echo "# done $(date -u +%FT%TZ)"
