#!/bin/sh
# Start this lab host's own Docker engine in the background (also used by tests that stop and restart it).
cgroup_parent="/${LAB_CGROUP_PARENT:-raycluster-lab-$(hostname)}"
rm -f /var/run/docker.pid
nohup dockerd --cgroup-parent="$cgroup_parent" --bridge=none --iptables=false >/var/log/dockerd.log 2>&1 &
