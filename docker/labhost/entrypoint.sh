#!/bin/sh
# Start a lab host: fresh SSH host keys, its own dockerd, then sshd in the foreground.
set -eu
ssh-keygen -A >/dev/null
/usr/local/sbin/labhost-start-dockerd
exec /usr/sbin/sshd -D -e
