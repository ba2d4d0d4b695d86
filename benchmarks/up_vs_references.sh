#!/usr/bin/env bash
# `raycluster up` against the references, in one run, on a local lab of HOSTS hosts, 3 by default (issue 11 item 6):
#   up        raycluster up (preflight, token, env files, head + workers) until every node is alive
#   floor     the hand floor: head container until its GCS answers (its port accepts a connection), then every
#             worker at once, until all alive
#   rayup_v1  Ray's own launcher: `ray up` (provider: local, docker:) with RAY_UP_enable_autoscaler_v2=0
#   rayup_v2  the same with Ray's default autoscaler (v2)
# Every variant starts from no Ray container with the image already on every host (a re-deploy) and ends
# when the head's GCS lists every node alive (our probe inside the head's container). The variants are
# alternated (a different one first each round); medians and ratios at the end, each run with the 1-minute
# load average before it. A `ray up` run that has not got every node by RAYUP_TIMEOUT (RAYUP_V2_TIMEOUT for
# autoscaler v2) is counted as that timeout (a lower bound, marked with >), with how many nodes were alive then.
# `ray up` needs rsync on the operator and on the hosts, ssh and `ray` on a login shell's PATH inside the
# image: the script builds raycluster/node-rayup (FROM the node image) and installs rsync in the lab hosts.
# Each run also records how busy this machine's CPUs were over it (/proc/stat: CPU-seconds used ÷ (wall × cores))
# and the CPU-seconds themselves: on a lab whose hosts share this machine's cores, a variant that keeps every
# core busy cannot be made faster by reordering its steps, only by doing less.
# Usage: benchmarks/up_vs_references.sh [ROUNDS]
#   (env: HOSTS, the lab's hosts, 3 by default (2 or more; give each size a lab name of its own);
#    RAYCLUSTER_LAB_NAME, RAYCLUSTER_NODE_IMAGE, RAYUP_TIMEOUT, RAYUP_V2_TIMEOUT; VARIANTS: which of
#    "up floor rayup_v1 rayup_v2 up_base" to alternate, the first four by default; BASELINE: a folder holding
#    another checkout, e.g. `git worktree add /tmp/base main`, whose `up` the variant up_base runs;
#    CPUSETS: the cores each lab host may use, one list per host separated by spaces: "0 1 1" puts the head
#    alone on core 0 and both workers on core 1, hosts that no longer share every core. Each host's own
#    processes (`docker update --cpuset-cpus`) and the cgroup its engine puts its containers under (the lab
#    host's name below the cpuset root) are pinned; every core again at the end; QUOTAS: a CPU quota for
#    each host's Ray container, one number per host separated by spaces ("0.66 0.66 0.66": three hosts that
#    each have two thirds of a core of their own, as hosts that share no CPU), for `up` (the lab's
#    inventory, `lab up --cpus`), the floor (the same `docker run` options) and `ray up` (its docker
#    run_options, one list for every host: only where QUOTAS gives every host the same quota);
#    TIMELINE=1: after each `up` and floor run, one line per node on stderr with when its container started,
#    its GCS and dashboard (head), its raylet and its registration, in ms after the run's start, from its
#    container and Ray logs)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
rayup_timeout=${RAYUP_TIMEOUT:-180}
rayup_v2_timeout=${RAYUP_V2_TIMEOUT:-$rayup_timeout}
py=$(realpath -s "${PYTHON:-.venv/bin/python}")  # absolute: run_up runs it from BASELINE too
ray=$(dirname "$py")/ray
rc="$py -m raycluster_cli"  # as the `raycluster` command runs (logins started before the CLI's imports)
docker=$(command -v /usr/bin/docker || command -v docker)
lab=${RAYCLUSTER_LAB_NAME:-raycluster-lab}
image=${RAYCLUSTER_NODE_IMAGE:-raycluster/node:0.1.0}
rayup_image="raycluster/node-rayup:${image##*:}"
read -r -a variants <<<"${VARIANTS:-up floor rayup_v1 rayup_v2}"
[[ " ${variants[*]} " != *" up_base "* ]] || [ -d "${BASELINE:-}/raycluster_cli" ] \
  || { echo "up_base needs BASELINE: a folder holding another checkout" >&2; exit 2; }
rayup=0; [[ " ${variants[*]} " == *" rayup_"* ]] && rayup=1
[ "$rayup" = 0 ] || command -v rsync >/dev/null || { apt-get install -y -qq rsync >/dev/null || { echo "rsync needed here" >&2; exit 1; }; }
nhosts=${HOSTS:-3}  # the lab's hosts: a head and HOSTS-1 workers
[ "$nhosts" -ge 2 ] || { echo "HOSTS: 2 or more" >&2; exit 2; }
hosts=$(seq 1 "$nhosts"); workers=$(seq 2 "$nhosts")
read -r -a quotas <<<"${QUOTAS:-}"
[ "${#quotas[@]}" = 0 ] || [ "${#quotas[@]}" = "$nhosts" ] || { echo "QUOTAS: give $nhosts numbers, one per host" >&2; exit 2; }
lab_cpus=(); floor_cpus=()  # per host: `lab up --cpus` and the floor's `docker run` options (the same quota)
for ((k = 0; k < ${#quotas[@]}; k++)); do
  lab_cpus+=(--cpus "lab-h$((k + 1))=${quotas[$k]}")
  floor_cpus[$((k + 1))]=$($py -c 'import sys; from raycluster_cli.lab.hosts import cpu_options; print(" ".join(cpu_options(sys.argv[1])))' "${quotas[$k]}")
done
inv=$($rc lab up --hosts "$nhosts" "${lab_cpus[@]}" --json 2>/dev/null | $py -c 'import json,sys; print(json.load(sys.stdin)["inventory"])')
field() { $py -c "import yaml; d = yaml.safe_load(open('$inv')); print($1)"; }
read -r -a ips <<<"$(field "' '.join(h['address'] for h in d['hosts'])")"
[ "${#ips[@]}" = "$nhosts" ] || { echo "the lab's inventory has ${#ips[@]} hosts, not $nhosts: use a lab name of its own" >&2; exit 2; }
ip1=${ips[0]}
all_ips=$(IFS=,; echo "${ips[*]}"); worker_ips=$(IFS=,; echo "${ips[*]:1}")
key=$(field "d['ssh']['key']")
work=$(mktemp -d)
now() { date +%s%N; }
elapsed() { echo "$(( ($(now) - $1) / 1000000 ))"; }  # milliseconds since $1
cpu_ticks() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9}' /proc/stat; }  # busy jiffies of all cores (user nice system irq softirq steal)
hz=$(getconf CLK_TCK); cores=$(nproc)
on() { $docker exec "$lab-h$1" "${@:2}"; }
alive() {  # alive CONTAINER TIMEOUT: until the head's GCS lists every node alive
  on 1 docker exec "$1" python -m raycluster_cli.host.probe --address "$ip1:6379" --expect "$all_ips" \
    --timeout "$2" >/dev/null
}

# --- what `ray up` needs, once ---------------------------------------------------------------------------
if [ "$rayup" = 1 ]; then
if ! $docker image inspect "$rayup_image" >/dev/null 2>&1 \
  || [ "$($docker image inspect --format '{{index .Config.Labels "io.raycluster.base"}}' "$rayup_image")" \
       != "$($docker image inspect --format '{{.Id}}' "$image")" ]; then
  mkdir -p "$work/rayup"
  cat >"$work/rayup/Dockerfile" <<EOF
FROM $image
RUN apt-get update && apt-get install -y --no-install-recommends openssh-client rsync \
 && rm -rf /var/lib/apt/lists/* && echo 'export PATH=/opt/ray/bin:\$PATH' >/etc/profile.d/ray.sh
LABEL io.raycluster.base="$($docker image inspect --format '{{.Id}}' "$image")"
EOF
  DOCKER_BUILDKIT=0 $docker build -q --network host -t "$rayup_image" "$work/rayup" >/dev/null
fi
for h in $hosts; do
  want=$($docker image inspect --format '{{.Id}}' "$rayup_image")
  if [ "$(on $h docker image inspect --format '{{.Id}}' "$rayup_image" 2>/dev/null)" != "$want" ]; then
    $docker save "$rayup_image" | $docker exec -i "$lab-h$h" docker load -q >/dev/null
  fi
  on $h sh -c 'command -v rsync >/dev/null || { apt-get update -qq && apt-get install -y -qq rsync; }' >/dev/null 2>&1 \
    || { echo "cannot install rsync in $lab-h$h (ray up needs it)" >&2; exit 1; }
done
fi
# `ray up`'s docker run_options are one list for all hosts: the hosts' quota when QUOTAS gives them all the same.
rayup_run_options='"--shm-size=1g"'
if [ "${#quotas[@]}" != 0 ] && [ "$rayup" = 1 ]; then
  if [ "$(printf '%s\n' "${quotas[@]}" | sort -u | wc -l)" = 1 ]; then
    for word in ${floor_cpus[1]}; do rayup_run_options+=", \"$word\""; done
  else
    echo "QUOTAS differ between hosts: ray up runs without them (its run_options are the same on every host)" >&2
  fi
fi
cat >"$work/rayup.yaml" <<EOF
cluster_name: rcbench
max_workers: $(( nhosts - 1 ))
upscaling_speed: 10.0
idle_timeout_minutes: 60
provider: {type: local, head_ip: $ip1, worker_ips: [$worker_ips]}
auth: {ssh_user: root, ssh_private_key: $key}
docker:
  image: $rayup_image
  container_name: rcbench_ray
  pull_before_run: false
  run_options: [$rayup_run_options]
head_start_ray_commands:
  - ray stop
  - ulimit -n 65536; ray start --head --port=6379 --node-ip-address=$ip1 --object-store-memory=300000000 --autoscaling-config=~/ray_bootstrap_config.yaml
worker_start_ray_commands:
  - ray stop
  - ulimit -n 65536; ray start --address=$ip1:6379 --object-store-memory=300000000
EOF

# --- the variants ------------------------------------------------------------------------------------------
clean() {
  $rc down -i "$inv" --json >/dev/null 2>&1 || true
  for h in $hosts; do on $h sh -c 'docker rm -f floor-ray rcbench_ray >/dev/null 2>&1' || true; done
}
timeline() {  # timeline T0: per node, the times (ms after T0) of its steps, from the Ray container on each host
  [ "${TIMELINE:-0}" = 1 ] || return 0
  local h line
  for h in $hosts; do
    line=$(on $h sh -c 'c=$(docker ps -q --filter label=io.raycluster.cluster --filter status=running | head -n1)
      [ -n "$c" ] || c=$(docker ps -q --filter name=^floor-ray$)
      [ -n "$c" ] || exit 0
      echo "started $(docker inspect --format "{{.State.StartedAt}}" "$c")"
      echo "registered $(docker logs -t "$c" 2>&1 | grep -m1 "Ray runtime started" | cut -d" " -f1)"
      docker exec "$c" sh -c "cd /tmp/ray/session_latest/logs 2>/dev/null || exit 0
        for f in gcs_server.out dashboard.log raylet.out dashboard_agent.log; do
          [ -f \$f ] && echo \"\$f \$(grep -m1 -oE \"[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9:]{8},[0-9]{3}\" \$f)\"
        done"' 2>/dev/null | $py -c '
import sys
from datetime import datetime, timezone
t0 = int(sys.argv[1]) / 1e9
out = []
for line in sys.stdin:
    what, _, when = line.strip().partition(" ")
    if not when:
        continue
    if "T" in when:  # Docker: RFC 3339 with nanoseconds, UTC
        stamp = datetime.fromisoformat(when[:26].rstrip("Z") + "+00:00").timestamp()
    else:  # Ray: local time (UTC in the image), milliseconds after a comma
        stamp = datetime.strptime(when, "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=timezone.utc).timestamp()
    out.append(f"{what.split(chr(46))[0]}+{(stamp - t0) * 1000:.0f}")
print(" ".join(out))' "$1")
    echo "  host $h: $line" >&2
  done
}
run_up() {  # run_up [FOLDER]: this checkout's `up`, or that of the checkout in FOLDER (-m finds it there)
  local t0 inv_abs; t0=$(now); inv_abs=$(realpath "$inv")
  (cd "${1:-.}" && $py -m raycluster_cli up -i "$inv_abs" --json >/dev/null 2>&1)
  elapsed "$t0"
  timeline "$t0"
}
run_floor() {
  local t0; t0=$(now)
  local opts=(docker run -d --name floor-ray --network host --shm-size 1g)
  # shellcheck disable=SC2086  # the host's quota options, one word each
  on 1 "${opts[@]}" ${floor_cpus[1]:-} "$image" ray start --head --port=6379 --node-ip-address="$ip1" --dashboard-host="$ip1" \
    --object-store-memory=300000000 --block >/dev/null
  # The GCS's port polled by a plain TCP connect from the head's host (since session 18; `ray health-check` in
  # the head's container before, a Python start every 0.5 s on the CPU the starting head needs).
  until on 1 bash -c "exec 3<>/dev/tcp/$ip1/6379" 2>/dev/null; do sleep 0.2; done
  echo "floor: the head's GCS answered $(elapsed "$t0") ms after the start; the workers start now" >&2
  for h in $workers; do
    ip=${ips[$((h - 1))]}
    # shellcheck disable=SC2086
    on $h "${opts[@]}" ${floor_cpus[$h]:-} "$image" ray start --address="$ip1:6379" --node-ip-address="$ip" \
      --object-store-memory=300000000 --block >/dev/null &
  done
  wait
  alive floor-ray 300
  elapsed "$t0"
  timeline "$t0"
}
run_rayup() {  # run_rayup V: autoscaler v1 (RAY_UP_enable_autoscaler_v2=0) or v2 (Ray's default)
  local t0 flag=(); t0=$(now)
  [ "$1" = v1 ] && flag=(env RAY_UP_enable_autoscaler_v2=0)
  local limit=$rayup_timeout; [ "$1" = v2 ] && limit=$rayup_v2_timeout
  "${flag[@]}" "$ray" up -y --no-config-cache "$work/rayup.yaml" >"$work/rayup-$1.log" 2>&1
  if alive rcbench_ray "$limit"; then elapsed "$t0"; else
    local n; n=$(on 1 docker exec rcbench_ray python -m raycluster_cli.host.probe --address "$ip1:6379" 2>/dev/null \
      | $py -c 'import json,sys; print(sum(n["alive"] for n in json.loads(sys.stdin.read().strip().splitlines()[-1])["nodes"]))' \
      2>/dev/null || echo "?")
    echo "ray up $1: $n of $nhosts nodes alive after ${limit}s (monitor log kept in $work/monitor-$1-*.log)" >&2
    on 1 docker exec rcbench_ray sh -c 'cat /tmp/ray/session_latest/logs/monitor.log' >"$work/monitor-$1-$(now).log" 2>&1 || true
    echo "-$(( limit * 1000 ))"
  fi
  "${flag[@]}" "$ray" down -y "$work/rayup.yaml" >>"$work/rayup-$1.log" 2>&1 || true
}

cpuset_dir() {  # the cgroup that lab host H's engine makes its containers' cgroups in (run on v1 only so far)
  if [ -d /sys/fs/cgroup/cpuset ]; then echo "/sys/fs/cgroup/cpuset/$lab-h$1"; else echo "/sys/fs/cgroup/$lab-h$1"; fi
}
pin() {  # pin H CPUS, with no container of the host's engine running (a cgroup v1 parent cannot shrink under them)
  local d; d=$(cpuset_dir "$1")
  $docker update --cpuset-cpus "$2" "$lab-h$1" >/dev/null
  [ -d "$d" ] || { mkdir "$d" && cat "$(dirname "$d")/cpuset.mems" >"$d/cpuset.mems"; }
  echo "$2" >"$d/cpuset.cpus"
}
all_cores="0-$(( cores - 1 ))"
clean
if [ -n "${CPUSETS:-}" ]; then
  read -r -a cpusets <<<"$CPUSETS"
  [ "${#cpusets[@]}" = "$nhosts" ] || { echo "CPUSETS: give $nhosts core lists, one per host" >&2; exit 2; }
  for h in $hosts; do pin "$h" "${cpusets[$((h - 1))]}"; done
  trap 'clean; for h in $hosts; do pin "$h" "$all_cores" || true; done' EXIT
fi
$rc up -i "$inv" --json >/dev/null 2>&1  # the first up makes the token and env files (what a re-deploy finds)
if [ -n "${CPUSETS:-}" ]; then  # what the pins gave each host's Ray container
  for h in $hosts; do
    echo "host $h: Ray container $(on $h sh -c 'docker exec $(docker ps -q --filter label=io.raycluster.cluster) \
      grep Cpus_allowed_list /proc/1/status' | tr -s '\t' ' ')" >&2
  done
fi
n=${#variants[@]}
for round in $(seq 1 "$rounds"); do
  for ((k = 0; k < n; k++)); do
    v=${variants[$(( (k + round - 1) % n ))]}
    clean
    load=$(cut -d' ' -f1 /proc/loadavg)
    ticks0=$(cpu_ticks)
    case $v in
      up) ms=$(run_up) ;;
      up_base) ms=$(run_up "$BASELINE") ;;
      floor) ms=$(run_floor) ;;
      rayup_v1) ms=$(run_rayup v1) ;;
      rayup_v2) ms=$(run_rayup v2) ;;
    esac
    cpu_s=$(awk -v a="$ticks0" -v b="$(cpu_ticks)" -v hz="$hz" 'BEGIN{printf "%.2f", (b - a) / hz}')
    echo "$round $v $ms $load $cpu_s" | tee -a "$work/runs" >&2
  done
done
clean
$py - "$work/runs" "$cores" <<'PY'
import statistics, sys
runs = [line.split() for line in open(sys.argv[1]) if line.strip()]
cores = int(sys.argv[2])
by = {}
cpu = {}
for _, variant, ms, load, cpu_s in runs:
    by.setdefault(variant, []).append((int(ms), float(load)))
    if int(ms) > 0:  # busy fraction over the run: CPU-seconds / (wall x cores)
        cpu.setdefault(variant, []).append((float(cpu_s), float(cpu_s) / (int(ms) / 1000 * cores)))
def fmt(ms):  # a negative figure: the run had not finished at that timeout
    return f">{-ms / 1000:.1f}" if ms < 0 else f"{ms / 1000:.1f}"
med = {}
for variant, values in by.items():
    med[variant] = statistics.median(abs(ms) for ms, _ in values) / 1000
    censored = " (some runs did not finish: lower bound)" if any(ms < 0 for ms, _ in values) else ""
    print(f"{variant:9s} runs(s)={' '.join(fmt(ms) for ms, _ in values)} "
          f"load1={' '.join(f'{load:.1f}' for _, load in values)} median={med[variant]:.1f}s{censored}")
    if variant in cpu:
        used = [c for c, _ in cpu[variant]]
        busy = [b for _, b in cpu[variant]]
        print(f"{'':9s} cpu_s={' '.join(f'{c:.1f}' for c in used)} busy={' '.join(f'{b:.2f}' for b in busy)} "
              f"median cpu_s={statistics.median(used):.1f} busy={statistics.median(busy):.2f} of {cores} cores")
for ref in ("floor", "rayup_v1", "rayup_v2", "up_base"):
    if ref in med and "up" in med:
        print(f"up / {ref} (medians): {med['up'] / med[ref]:.2f}")
PY
