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


# Interfaces that carry container or VM traffic, never a node's own address.
_BRIDGE_PREFIXES = ("docker", "br-", "veth", "virbr", "cni", "flannel", "cali", "tunl", "weave", "podman", "kube-")


def is_container_bridge(name: str) -> bool:
    return name.startswith(_BRIDGE_PREFIXES) or name == "lo"


def node_addresses(interfaces: list[Interface]) -> list[Interface]:
    """The global IPv4 addresses that could carry Ray traffic (container bridges and loopback left out)."""
    return [i for i in interfaces if i.scope == "global" and not is_container_bridge(i.name)]


def parse_link_mtu(text: str) -> dict[str, int]:
    """Interface name → MTU from `ip -o link show` (`eth0@if85` is reported as `eth0`)."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"^\d+:\s+([^:@\s]+)(?:@\S+)?:\s+<[^>]*>.*?\bmtu\s+(\d+)", line)
        if match:
            found[match.group(1)] = int(match.group(2))
    return found


@dataclass(frozen=True)
class Firewall:
    checked: bool
    drops: bool
    detail: str


def parse_input_policy(iptables: str, nft: str) -> Firewall:
    """Whether inbound traffic is dropped by default, from `iptables -S INPUT` and `nft list ruleset`.

    Best effort: without root (or without either tool) the answer is `checked=False`.
    """
    for line in iptables.splitlines():
        match = re.match(r"^-P\s+INPUT\s+(\S+)", line.strip())
        if match:
            policy = match.group(1)
            if policy in ("DROP", "REJECT"):
                return Firewall(True, True, f"iptables INPUT policy {policy}")
            checked_iptables = True
            break
    else:
        checked_iptables = False
    for line in nft.splitlines():
        if re.search(r"\bhook\s+input\b.*\bpolicy\s+drop\b", line):
            return Firewall(True, True, "nftables input chain policy drop")
    checked_nft = "table " in nft
    return Firewall(checked_iptables or checked_nft, False, "")


@dataclass(frozen=True)
class ClockReading:
    skew_s: float  # host clock minus operator clock (at the midpoint of the round trip)
    uncertainty_s: float  # half the round trip plus the host clock's resolution


def parse_clock(text: str) -> ClockReading | None:
    """From `operator <sent> <received>`, the host's `date +%s.%N` (busybox prints a literal %N) and, when the
    reading was taken in a batch of commands, `elapsed <s>`: the host's time from the start to the end of the
    batch, which the round trip is known to contain (so it narrows the uncertainty)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) < 2 or not lines[0].startswith("operator "):
        return None
    try:
        _, sent, received = lines[0].split()
        t0, t1 = float(sent), float(received)
    except ValueError:
        return None
    match = re.match(r"^(\d+)(?:\.(\d+))?", lines[1])
    if not match:
        return None
    resolution = 0.0 if match.group(2) else 1.0
    host = float(match.group(1) + "." + (match.group(2) or "0"))
    busy = _elapsed(lines[2:], t1 - t0)
    # The host read its clock at some operator time in [t0, t1 - busy]: take the middle of that window.
    midpoint = (t0 + t1 - busy) / 2
    return ClockReading(host - midpoint, (t1 - t0 - busy) / 2 + resolution)


def _elapsed(lines: list[str], round_trip: float) -> float:
    for line in lines:
        if line.startswith("elapsed "):
            try:
                value = float(line.split()[1])
            except (IndexError, ValueError):
                return 0.0
            return value if 0.0 <= value <= round_trip else 0.0
    return 0.0
