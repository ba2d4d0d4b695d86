#!/bin/sh
# Start a lab host: fresh SSH host keys, its own dockerd (cgroup parent named after the host), then sshd.
set -eu
ssh-keygen -A >/dev/null
cgroup_parent="/${LAB_CGROUP_PARENT:-raycluster-lab-$(hostname)}"
dockerd --cgroup-parent="$cgroup_parent" --bridge=none --iptables=false \
  >/var/log/dockerd.log 2>&1 &
exec /usr/sbin/sshd -D -e
