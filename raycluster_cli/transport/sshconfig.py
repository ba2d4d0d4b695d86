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
from typing import Any

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
        config = paramiko.SSHConfig.from_path(str(file))
    except (OSError, paramiko.ConfigParseError) as exc:
        raise InventoryError(f"ssh config {file}: {exc}", "fix that file, or set ssh.config_file: null") from None
    setattr(config, _PATH, str(file))  # named in errors about its entries
    return config


# Options that change how OpenSSH reaches a host or checks its key, which raycluster does not follow: refused
# rather than silently ignored (the host would be dialled directly, its key looked up under its address).
_PATH = "_raycluster_path"
_DEFAULT_GLOBAL = "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"
_NOT_FOLLOWED = {
    "proxycommand": ("ProxyCommand", "use ProxyJump (or the inventory's ssh.proxy_jump) instead"),
    "hostkeyalias": ("HostKeyAlias", "record the host's key under its address (ssh-keyscan) and remove HostKeyAlias"),
    "globalknownhostsfile": (
        "GlobalKnownHostsFile",
        "set the inventory's ssh.known_hosts_file to that file (raycluster reads /etc/ssh/ssh_known_hosts itself)",
    ),
}


def _check_entry(config: paramiko.SSHConfig, name: str, entry: dict[str, Any], *, proxied: bool) -> None:
    """Refuse what raycluster would not follow in `name`'s config entry; `proxied`: the inventory gives the jump."""
    where = f"ssh config {getattr(config, _PATH, '')}".rstrip()
    for option, (spelled, fix) in _NOT_FOLLOWED.items():
        value = entry.get(option)
        if value is None or (option == "proxycommand" and (proxied or str(value).lower() == "none")):
            continue
        if option == "globalknownhostsfile" and " ".join(value.split()) == _DEFAULT_GLOBAL:
            continue
        raise InventoryError(
            f"{where}: {spelled} for {name} is not supported by raycluster", f"{fix}, or set ssh.config_file: null"
        )


def _port(config: paramiko.SSHConfig, name: str, value: Any) -> int:
    try:
        port = int(str(value))
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        where = f"ssh config {getattr(config, _PATH, '')}".rstrip()
        raise InventoryError(f"{where}: Port {value!r} for {name} is not a port number", "write Port 22 (1-65535)")
    return port


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
    _check_entry(config, address, entry, proxied=bool(_explicit(inventory, host, "proxy_jump")))
    user = _explicit(inventory, host, "user") or entry.get("user") or defaults.user
    port = _explicit(inventory, host, "port") or (_port(config, address, entry["port"]) if "port" in entry else 0)
    port = port or defaults.port
    key = _explicit(inventory, host, "key") or _first_key(entry.get("identityfile")) or defaults.key
    target = Hop(entry.get("hostname", address), int(str(port)), str(user), str(key) if key else None)
    jump_value = _explicit(inventory, host, "proxy_jump") or entry.get("proxyjump")
    if not jump_value:
        return Route(target)
    field = "hosts[].ssh.proxy_jump" if host.ssh.proxy_jump else "ssh.proxy_jump"
    specs = parse_jumps(str(jump_value), field)
    jumps = tuple(_jump_hop(spec, config, defaults.user, defaults.key, address) for spec in specs)
    return Route(target, jumps)


def _jump_hop(spec: JumpSpec, config: paramiko.SSHConfig, user: str, key: str | None, target: str) -> Hop:
    entry = config.lookup(spec.host)
    name = f"{spec.host} (jump host of {target})"
    _check_entry(config, name, entry, proxied=False)
    return Hop(
        entry.get("hostname", spec.host),
        spec.port or (_port(config, name, entry["port"]) if "port" in entry else 22),
        spec.user or entry.get("user") or user,
        _first_key(entry.get("identityfile")) or key,
    )
