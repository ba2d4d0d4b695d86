"""How to reach a host the way OpenSSH would: `~/.ssh/config` (Host patterns and aliases, HostName,
User, Port, IdentityFile, ProxyJump) and the inventory's `ssh.proxy_jump` (cluster-wide or per host).

Precedence, as OpenSSH gives the command line precedence over the config file: what the inventory sets
explicitly (the host's own `ssh:` first, then the cluster's), then the matching `~/.ssh/config` entries,
then the inventory's defaults. A jump host is reached the same way (its own config entry: alias, HostName,
User, Port, IdentityFile); without one it uses the inventory's user and key. Each hop's host key is
verified against the same known_hosts file with the same policy as the targets; one connection per jump
host is shared by every host behind it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import paramiko

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.errors import InventoryError

_JUMP = re.compile(r"^(?:(?P<user>[^@\s,:]+)@)?(?P<host>\[[0-9A-Fa-f:]+\]|[^@\s,:\[\]]+)(?::(?P<port>\d{1,5}))?$")


@dataclass(frozen=True)
class Hop:
    """One SSH login: where to connect (after HostName), as whom, with which key."""

    host: str
    port: int
    user: str
    key: str | None

    @property
    def label(self) -> str:
        return f"{self.user}@{self.host}" + (f":{self.port}" if self.port != 22 else "")


@dataclass(frozen=True)
class Route:
    """A target host and the jump hosts in front of it, outermost first."""

    target: Hop
    jumps: tuple[Hop, ...] = ()


@dataclass(frozen=True)
class JumpSpec:
    user: str | None
    host: str
    port: int | None


def parse_jumps(value: str, field: str = "ssh.proxy_jump") -> list[JumpSpec]:
    """`user@host[:port][,user@host[:port]…]` (OpenSSH's ProxyJump) → hops; 'none' → no jump."""
    if value.strip().lower() == "none":
        return []
    hops = []
    for part in value.split(","):
        match = _JUMP.match(part.strip())
        port = int(match["port"]) if match and match["port"] else None
        if not match or (port is not None and not 1 <= port <= 65535):
            raise InventoryError(
                f"{field}: {part.strip()!r} is not [user@]host[:port]", "e.g. proxy_jump: admin@bastion.example:22"
            )
        hops.append(JumpSpec(match["user"], match["host"].strip("[]"), port))
    return hops


def load_config(path: str | None) -> paramiko.SSHConfig:
    """The OpenSSH client config at `path` (an empty one when unset or absent)."""
    if not path:
        return paramiko.SSHConfig()
    file = Path(os.path.expanduser(path))
    if not file.is_file():
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(str(file))
    except (OSError, paramiko.ConfigParseError) as exc:
        raise InventoryError(f"ssh config {file}: {exc}", "fix that file, or set ssh.config_file: null") from None


def _first_key(files: Iterable[str] | None) -> str | None:
    """The first IdentityFile that exists (OpenSSH tries each; paramiko takes one key file)."""
    for file in files or []:
        if Path(os.path.expanduser(file)).is_file():
            return file
    return None


def _explicit(inventory: Inventory, host: HostConfig, name: str) -> object | None:
    """An ssh setting the inventory gives explicitly for `host` (its own, else the cluster's), or None."""
    own = getattr(host.ssh, name, None)
    if own is not None:
        return own
    return getattr(inventory.ssh, name) if name in inventory.ssh.model_fields_set else None


def resolve(inventory: Inventory, host: HostConfig, config: paramiko.SSHConfig) -> Route:
    """Where and how to log in to `host`, and through which jump hosts (pure, given the config)."""
    address = str(host.address)
    entry = config.lookup(address)
    defaults = inventory.ssh_for(host)
    user = _explicit(inventory, host, "user") or entry.get("user") or defaults.user
    port = _explicit(inventory, host, "port") or int(entry.get("port", 0)) or defaults.port
    key = _explicit(inventory, host, "key") or _first_key(entry.get("identityfile")) or defaults.key
    target = Hop(entry.get("hostname", address), int(str(port)), str(user), str(key) if key else None)
    jump_value = _explicit(inventory, host, "proxy_jump") or entry.get("proxyjump")
    if not jump_value:
        return Route(target)
    field = "hosts[].ssh.proxy_jump" if host.ssh.proxy_jump else "ssh.proxy_jump"
    jumps = tuple(_jump_hop(spec, config, defaults.user, defaults.key) for spec in parse_jumps(str(jump_value), field))
    return Route(target, jumps)


def _jump_hop(spec: JumpSpec, config: paramiko.SSHConfig, user: str, key: str | None) -> Hop:
    entry = config.lookup(spec.host)
    return Hop(
        entry.get("hostname", spec.host),
        spec.port or int(entry.get("port", 22)),
        spec.user or entry.get("user") or user,
        _first_key(entry.get("identityfile")) or key,
    )
