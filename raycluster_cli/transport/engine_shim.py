"""The container engine on a host: `docker` (default), `podman`, or a command prefix such as `sudo -n docker`.

Every command raycluster sends is written with
the Docker CLI's grammar (`docker run …`, `docker ps --format …`), which Podman's CLI shares for most
verbs; a host whose `docker.engine` is not plain `docker` gets a preamble in front of each command that puts
a `docker` shim first on PATH (a two-line script in the login user's cache folder, `exec podman "$@"`), so
every `docker` word of that command — in pipelines, `&&` chains, `timeout docker …` and nested `bash -c`
too — runs the inventory's engine, and no module builds its own engine command line. (A shell function
would not do: `timeout` and `bash -c` run programs, not the calling shell's functions.)

Where the engines' CLIs answer differently is host/engine.py's concern (the dialects). This wrapper sits in the
transport layer, as Ray's DockerCommandRunner and pyinfra's DockerSSHConnector keep theirs in the runner layer.
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Callable
from typing import Any, BinaryIO

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.transport.base import CommandResult, Transport

DEFAULT = "docker"


def engine_of(inventory: Inventory, host: HostConfig) -> str:
    return host.docker.engine or inventory.docker.engine or DEFAULT


def preamble(engine: str) -> str:
    """The shell text put in front of every command for this engine ('' for plain docker): it writes the
    engine's `docker` shim once per user (named by a digest of the engine) and puts its folder first on PATH.
    The shim takes its own folder off PATH again, so that an engine such as `docker --tls` is not the shim."""
    if engine == DEFAULT:
        return ""
    digest = hashlib.sha256(engine.encode()).hexdigest()[:12]
    lines = ["#!/bin/sh", 'PATH="${PATH#"${0%/*}:"}"', f'exec {shlex.join(shlex.split(engine))} "$@"']
    write = f"printf '%s\\n' {' '.join(shlex.quote(line) for line in lines)} > \"$_rc_engine/docker.$$\""
    return (
        f'_rc_engine="${{XDG_CACHE_HOME:-$HOME/.cache}}/raycluster/engine-{digest}"; '
        f'[ -x "$_rc_engine/docker" ] || {{ mkdir -p "$_rc_engine" && {write} && chmod 700 "$_rc_engine/docker.$$" '
        f'&& mv -f "$_rc_engine/docker.$$" "$_rc_engine/docker"; }} '
        f'|| {{ echo "raycluster: cannot write the engine shim $_rc_engine/docker" >&2; exit 125; }}; '
        'PATH="$_rc_engine:$PATH"; export PATH; '
    )


class EngineTransport:
    """A host's transport whose commands run `docker` as the inventory's engine for that host."""

    def __init__(self, inner: Transport, engine: str) -> None:
        self.inner = inner
        self.engine = engine
        self.prefix = preamble(engine)
        self.host = inner.host

    def engine_command(self, command: str) -> str:
        return self.prefix + command

    def run(self, command: str, **options: Any) -> CommandResult:
        return self.inner.run(self.engine_command(command), **options)

    def feed(self, command: str, source: BinaryIO, **options: Any) -> CommandResult:
        return self.inner.feed(self.engine_command(command), source, **options)

    def stream(self, command: str, on_output: Callable[[str, bytes], None], **options: Any) -> int:
        """The SSH transport's streaming run (logs, exec), with the engine's preamble like every command."""
        stream: Callable[..., int] = self.inner.stream  # type: ignore[attr-defined]
        return stream(self.engine_command(command), on_output, **options)

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
