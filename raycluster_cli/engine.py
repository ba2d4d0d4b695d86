"""The container engine on a host: `docker` (default), `podman`, or a command prefix such as `sudo -n docker`.

This is the one place that decides which program runs an engine command on a host. Every command
raycluster sends is written with the Docker CLI's grammar (`docker run …`, `docker ps --format …`), which
Podman's CLI shares; a host whose `docker.engine` is not plain `docker` gets a shell function in front of
each command (`docker() { podman "$@"; }`), so every `docker` word of that command — in pipelines and
`&&` chains too — runs the inventory's engine, and no module builds its own engine command line.
"""

from __future__ import annotations

from typing import Any, BinaryIO

from .inventory import HostConfig, Inventory
from .transport.base import CommandResult, Transport

DEFAULT = "docker"


def engine_of(inventory: Inventory, host: HostConfig) -> str:
    return host.docker.engine or inventory.docker.engine or DEFAULT


def preamble(engine: str) -> str:
    """The shell text put in front of every command for this engine ('' for plain docker)."""
    if engine == DEFAULT:
        return ""
    return f'docker() {{ {engine} "$@"; }}; '


class EngineTransport:
    """A host's transport whose commands run `docker` as the inventory's engine for that host."""

    def __init__(self, inner: Transport, engine: str) -> None:
        self.inner = inner
        self.engine = engine
        self.prefix = preamble(engine)
        self.host = inner.host

    def engine_command(self, command: str) -> str:
        return self.prefix + command

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 120.0) -> CommandResult:
        return self.inner.run(self.engine_command(command), stdin=stdin, timeout=timeout)

    def feed(self, command: str, source: BinaryIO, **options: Any) -> CommandResult:
        return self.inner.feed(self.engine_command(command), source, **options)

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        self.inner.put(data, path, mode)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # paramiko_transport, running, … of the SSH transport


def with_engine(inventory: Inventory, host: HostConfig, transport: Transport) -> Transport:
    """`transport` itself for plain docker, else one that runs the host's engine."""
    engine = engine_of(inventory, host)
    return transport if engine == DEFAULT else EngineTransport(transport, engine)
