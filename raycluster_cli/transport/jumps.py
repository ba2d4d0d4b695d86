"""Jump hosts (ProxyJump): one SSH connection per jump host, shared by every target behind it; each
target's socket is a `direct-tcpip` channel opened on the jump host's connection (as `ssh -J`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import paramiko

from raycluster_cli.errors import TransportError
from raycluster_cli.transport.sshconfig import Hop, Route

Sock = Callable[[float], Any]
MakeTransport = Callable[[Hop, "Sock | None"], Any]  # an SSHTransport to `hop` (through `sock` when given)


class JumpHosts:
    """The jump hosts of one pool: made on first use, closed together."""

    def __init__(self, make: MakeTransport) -> None:
        self.make = make
        self._open: dict[tuple[Hop, ...], Any] = {}
        self._lock = threading.RLock()  # sock_for of a chain makes its outer hops

    def sock_for(self, route: Route) -> Sock | None:
        """How to open the socket to `route.target` (None: connect directly)."""
        if not route.jumps:
            return None
        jump = self._transport(route.jumps)
        last = route.jumps[-1]
        dest = (route.target.host, route.target.port)

        def open_sock(timeout: float) -> paramiko.Channel:
            try:
                channel: paramiko.Channel = jump.paramiko_transport().open_channel(
                    "direct-tcpip", dest, ("127.0.0.1", 0), timeout=timeout
                )
            except paramiko.ChannelException as exc:
                raise TransportError(
                    route.target.host,
                    f"jump host {last.label} could not connect to {dest[0]}:{dest[1]} ({exc.text or exc})",
                    f"check that {last.host} reaches it (route, firewall, sshd on the host)",
                ) from None
            except (EOFError, paramiko.SSHException, OSError) as exc:
                raise TransportError(
                    route.target.host,
                    f"jump host {last.label} dropped the connection ({type(exc).__name__}: {exc})",
                    f"check sshd on {last.host} (AllowTcpForwarding, MaxSessions)",
                ) from None
            return channel

        return open_sock

    def _transport(self, chain: tuple[Hop, ...]) -> Any:
        """The (not yet connected) transport to the last hop of `chain`, through the hops before it."""
        with self._lock:
            if chain not in self._open:
                sock = self.sock_for(Route(chain[-1], chain[:-1])) if len(chain) > 1 else None
                self._open[chain] = self.make(chain[-1], sock)
            return self._open[chain]

    def close(self) -> None:
        with self._lock:
            transports = list(self._open.values())
            self._open.clear()
        for transport in reversed(transports):
            transport.close()
