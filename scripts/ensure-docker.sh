#!/usr/bin/env bash
# Make sure a Docker engine answers on this machine: install Debian's docker.io when absent, start dockerd.
set -euo pipefail
log() { echo "[ensure-docker] $*" >&2; }
if [ -x /usr/bin/docker ] && /usr/bin/docker info >/dev/null 2>&1; then
  log "engine already answers"; exit 0
fi
need=()
[ -x /usr/sbin/dockerd ] || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v ip >/dev/null || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi
if ! /usr/bin/docker info >/dev/null 2>&1; then
  log "starting dockerd"
  mkdir -p /var/log
  nohup /usr/sbin/dockerd >/var/log/raycluster-dockerd.log 2>&1 &
  for _ in $(seq 1 60); do
    /usr/bin/docker info >/dev/null 2>&1 && break
    sleep 1
  done
fi
/usr/bin/docker info >/dev/null 2>&1 || { log "dockerd did not answer; see /var/log/raycluster-dockerd.log"; exit 1; }
log "engine answers"
