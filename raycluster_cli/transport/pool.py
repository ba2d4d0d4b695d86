"""The one way library code reaches a host: a `Connect` callable, and the SSH pool that implements it."""

from __future__ import annotations

from collections.abc import Callable

from ..inventory import HostConfig, Inventory
from .base import Transport
from .ssh import SSHTransport

Connect = Callable[[HostConfig], Transport]


class SSHPool:
    """One SSH connection per host, opened on first use, closed together."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self._open: dict[str, Transport] = {}

    def __call__(self, host: HostConfig) -> Transport:
        key = str(host.address)
        if key not in self._open:
            ssh = self.inventory.ssh_for(host)
            transport = SSHTransport(
                key,
                user=ssh.user,
                port=ssh.port,
                key_file=ssh.key,
                known_hosts=ssh.known_hosts,
                known_hosts_file=ssh.known_hosts_file,
                connect_timeout=ssh.connect_timeout_s,
            )
            transport.connect()
            self._open[key] = transport
        return self._open[key]

    def close(self) -> None:
        for transport in self._open.values():
            transport.close()
        self._open.clear()
