"""The one way library code reaches a host: a `Connect` callable, and the SSH pool that implements it.

One connection per host, opened on first use and reused by every later phase of the verb. Logins go
through one gate: at most `ssh.max_parallel_logins` handshakes at once, started a few milliseconds apart,
so that a few hundred hosts behind one bastion do not trip its sshd's MaxStartups (10 unauthenticated
connections by default, beyond which it drops new ones).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable

from raycluster_cli import cancel
from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.transport import prefetch
from raycluster_cli.transport.base import Transport
from raycluster_cli.transport.engine_shim import with_engine
from raycluster_cli.transport.gate import Ahead, LoginGate
from raycluster_cli.transport.jumps import JumpHosts
from raycluster_cli.transport.ssh import Sock, SSHTransport
from raycluster_cli.transport.sshconfig import Hop, Route, load_config, resolve

Connect = Callable[[HostConfig], Transport]


class SSHPool:
    """One SSH connection per host, opened on first use (through the login gate), closed together.

    Hosts are reached as OpenSSH would (`~/.ssh/config`, `ssh.proxy_jump`: see sshconfig.py), behind one
    shared connection per jump host (jumps.py); each host's engine commands go through engine.py."""

    def __init__(self, inventory: Inventory, gate: LoginGate | None = None) -> None:
        self.inventory = inventory
        self.gate = gate or LoginGate(inventory.ssh.max_parallel_logins)
        self._open: dict[str, SSHTransport] = {}
        self._ahead: dict[str, Ahead] = {}  # logins started ahead, until each host's first use
        self._firsts: dict[str, prefetch.Recipe] = {}  # of closed transports (see first_read_only)
        # Re-entrant: a Ctrl-C handler runs in the main thread and asks `running()` while that thread may be
        # inside `transport()` (up connects the head from it); a plain Lock deadlocked the handler there.
        self._lock = threading.RLock()
        self.ssh_config = load_config(inventory.ssh.config_file)
        self.jumps = JumpHosts(self._jump_transport)

    def _options(self, host: HostConfig | None) -> dict[str, object]:
        ssh = self.inventory.ssh_for(host) if host else self.inventory.ssh
        return {
            "known_hosts": ssh.known_hosts,
            "known_hosts_file": ssh.known_hosts_file,
            "connect_timeout": ssh.connect_timeout_s,
            "keepalive_s": ssh.keepalive_interval_s,
            "keepalive_count": ssh.keepalive_count_max,
            "stall_s": ssh.stall_timeout_s,
            "retries": ssh.connect_retries,
        }

    def _jump_transport(self, hop: Hop, sock: Sock | None) -> SSHTransport:
        """A jump host's connection: outside the login gate (a target holds a slot while its jump logs in)."""
        return SSHTransport(hop.host, user=hop.user, port=hop.port, key_file=hop.key, sock=sock, **self._options(None))  # type: ignore[arg-type]

    def login_params(self, host: HostConfig) -> dict[str, object] | None:
        """How this host is logged in to (SSHTransport's arguments), or None if it is behind a jump host.

        What logins.py keeps from one run to start the next run's logins before the inventory is read."""
        route = resolve(self.inventory, host, self.ssh_config)
        if route.jumps:
            return None
        return self._params(route, host)

    def _params(self, route: Route, host: HostConfig) -> dict[str, object]:
        target = route.target
        return {
            "host": target.host,
            "user": target.user,
            "port": target.port,
            "key_file": target.key,
            **self._options(host),
        }

    def transport(self, host: HostConfig) -> SSHTransport:
        """This host's transport (not yet connected on first use)."""
        key = str(host.address)
        with self._lock:
            if key not in self._open:
                route = resolve(self.inventory, host, self.ssh_config)
                self._open[key] = SSHTransport(
                    sock=self.jumps.sock_for(route),
                    gate=self.gate,
                    **self._params(route, host),  # type: ignore[arg-type]
                )
            return self._open[key]

    def adopt(self, host: HostConfig, transport: SSHTransport, ahead: Ahead) -> None:
        """Take `transport` (a login logins.py started for this host with its `login_params`) as this host's,
        its login handed to the host's first use as a login started ahead."""
        with self._lock:
            self._open[str(host.address)] = transport
            self._ahead[str(host.address)] = ahead

    def log_in_ahead(self, hosts: Iterable[HostConfig]) -> None:
        """Start these hosts' logins now, in the background, while the caller does other work.

        At most `ssh.max_parallel_logins` threads (the login gate applies as always), daemon threads so a
        login that hangs never holds the process's exit. A host's first use waits for its login and sees
        its failure, once (a later use logs in afresh, as without this); a host no thread reached yet is
        logged in by its first user."""
        with self._lock:
            queue = deque(h for h in hosts if str(h.address) not in self._ahead)
            for host in queue:
                self._ahead[str(host.address)] = Ahead()
        workers = min(len(queue), self.inventory.ssh.max_parallel_logins)
        for _ in range(workers):
            threading.Thread(target=self._log_in_queued, args=(queue,), name="login-ahead", daemon=True).start()

    def _log_in_queued(self, queue: deque[HostConfig]) -> None:
        while True:
            with self._lock:
                if not queue:
                    return
                host = queue.popleft()
                ahead = self._ahead.get(str(host.address))
                if ahead is None:
                    continue  # its first user came first and logs in itself
                ahead.started = True
            try:
                ahead.attempt(lambda: self.transport(host).connect())  # noqa: B023 (called at once)
            finally:
                ahead.done.set()

    def _wait_ahead(self, host: HostConfig) -> None:
        """The login started ahead for this host, if any: wait for it; its failure is raised here, once."""
        with self._lock:
            ahead = self._ahead.pop(str(host.address), None)
        if ahead is None or not ahead.started:
            return
        while not ahead.done.wait(0.2):
            cancel.check(f"connecting to {host.address}")
        if ahead.error is not None:
            raise ahead.error

    def __call__(self, host: HostConfig) -> Transport:
        self._wait_ahead(host)
        transport = self.transport(host)
        transport.connect()
        return with_engine(self.inventory, host, transport)

    def running(self) -> list[dict[str, str]]:
        """Every command running now, per host (what an interrupted verb had started)."""
        with self._lock:
            transports = list(self._open.values())
        return [{"host": t.host, "command": command} for t in transports for command in t.running()]

    def first_read_only(self) -> dict[str, prefetch.Recipe]:
        """Per host, the first command the verb declared read-only (prefetch.py), also once closed."""
        with self._lock:
            return {**self._firsts, **self._current_firsts()}

    def _current_firsts(self) -> dict[str, prefetch.Recipe]:
        return {key: t.first_read_only for key, t in self._open.items() if t.first_read_only is not None}

    def close(self) -> None:
        with self._lock:
            self._firsts.update(self._current_firsts())
            transports = list(self._open.values())
            self._open.clear()
        for transport in transports:
            transport.close()
        self.jumps.close()
