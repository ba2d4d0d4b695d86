#!/bin/sh
# Start a podman lab host: fresh SSH host keys, then sshd in the foreground (podman needs no daemon).
set -eu
ssh-keygen -A >/dev/null
exec /usr/sbin/sshd -D -e
