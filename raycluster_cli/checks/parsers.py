"""Pure parsers of command output, tested from recorded outputs."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Interface:
    name: str
    address: str
    prefix: int
    scope: str


def parse_ip_addr(text: str) -> list[Interface]:
    """Parse `ip -o -4 addr show` (IPv6 lines, if any, are skipped)."""
    found = []
    pattern = re.compile(r"^\d+:\s+(\S+?)(?:@\S+)?\s+inet\s+(\d+\.\d+\.\d+\.\d+)/(\d+).*?\bscope\s+(\S+)")
    for line in text.splitlines():
        match = pattern.search(line)
        if match:
            name, address, prefix, scope = match.groups()
            found.append(Interface(name, address, int(prefix), scope))
    return found


def parse_etc_hosts(text: str) -> list[tuple[str, list[str]]]:
    """(address, names) per line of /etc/hosts, in file order; comments and blank lines dropped."""
    entries = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) >= 2:
            entries.append((fields[0], fields[1:]))
    return entries


def resolve_in_hosts(entries: list[tuple[str, list[str]]], name: str) -> str | None:
    """The IPv4 address glibc would return for `name` from these entries (first match wins)."""
    for address, names in entries:
        if name.lower() in (n.lower() for n in names) and _is_ipv4(address):
            return address
    return None


def parse_route_source(text: str) -> str | None:
    """The `src` address of `ip route get <dst>`."""
    match = re.search(r"\bsrc\s+(\d+\.\d+\.\d+\.\d+)", text)
    return match.group(1) if match else None


def is_loopback(address: str) -> bool:
    return _is_ipv4(address) and ipaddress.ip_address(address).is_loopback


def _is_ipv4(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
    except ValueError:
        return False


def parse_listening_ports(text: str) -> set[int]:
    """TCP ports in LISTEN state from `ss -ltnH` (IPv4, IPv6 and wildcard local addresses)."""
    ports = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[0] == "LISTEN":
            local = fields[3]
            port = local.rsplit(":", 1)[-1]
            if port.isdigit():
                ports.add(int(port))
    return ports
