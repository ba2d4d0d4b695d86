"""Which of Ray's ports a host's INPUT rules drop, from `iptables -S INPUT` and `nft list ruleset` (pure).

A default DROP policy is one way to block Ray (parsers.parse_input_policy); a rule is the other, and the more
common: `-A INPUT -p tcp --dport 6379 -j DROP`, a multiport REJECT of the worker range, a catch-all
`-A INPUT -j DROP` at the end of a chain whose policy is ACCEPT. Rules are read in order as the kernel does:
for each port range Ray needs, the first rule that would take a new TCP connection from another host
decides. An ACCEPT or DROP that names a source, an interface or a connection state may or may not apply to
the cluster's hosts: it makes the answer "restricted" (check the sources), never "fine" or "blocked".
Best effort: a rule this reader does not understand is passed over.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PortRange = tuple[int, int]  # inclusive
_RESTRICTING_IPTABLES = ("-s", "--source", "-i", "--in-interface", "--ctstate", "--state", "--src-range", "--match-set")
_RESTRICTING_NFT = ("saddr", "iifname", "iif ", "ct state", "meta iif")


@dataclass(frozen=True)
class Rule:
    text: str  # as the host printed it
    verdict: str  # "accept" or "drop" (DROP and REJECT alike)
    ports: tuple[PortRange, ...] | None  # destination TCP ports; None: every port
    negated: bool  # `! --dport`: every port but these
    restricted: bool  # it names a source, an interface or a state


@dataclass(frozen=True)
class Blocked:
    """A port range Ray needs that a rule drops: `restricted` when that rule (or an ACCEPT before it) names a
    source, interface or state, so it may spare the cluster's hosts."""

    name: str  # "6379 (GCS)", "worker ports 10002-19999"
    rule: str
    restricted: bool


def _ranges(text: str) -> tuple[PortRange, ...]:
    found = []
    for part in re.split(r"[,\s]+", text.strip("{} ")):
        bounds = re.fullmatch(r"(\d+)(?:[:-](\d+))?", part)
        if bounds:
            low = int(bounds.group(1))
            found.append((low, int(bounds.group(2) or low)))
    return tuple(found)


def _iptables_rule(line: str) -> Rule | None:
    words = line.split()
    if len(words) < 2 or words[:2] != ["-A", "INPUT"] or "-j" not in words:
        return None
    target = words[words.index("-j") + 1] if words.index("-j") + 1 < len(words) else ""
    verdict = {"ACCEPT": "accept", "DROP": "drop", "REJECT": "drop"}.get(target)
    if verdict is None:
        return None
    if "-p" in words and words[words.index("-p") + 1 :][:1] not in (["tcp"], ["all"]):
        return None  # another protocol: Ray's connections are TCP
    ports, negated = None, False
    for flag in ("--dport", "--dports", "--destination-port", "--destination-ports"):
        if flag in words and words.index(flag) + 1 < len(words):
            at = words.index(flag)
            ports, negated = _ranges(words[at + 1]), words[at - 1] == "!"
    restricted = any(flag in words for flag in _RESTRICTING_IPTABLES)
    return Rule(line.strip(), verdict, ports, negated, restricted)


def _nft_rules(text: str) -> list[Rule]:
    """The rules of nft chains hooked on input (a chain's `type filter hook input` line comes first in it)."""
    rules: list[Rule] = []
    in_input = False
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("chain "):
            in_input = False
        elif "hook input" in line:
            in_input = True
        elif in_input and re.search(r"\b(accept|drop|reject)\b", line):
            verdict = "accept" if re.search(r"\baccept\b", line) else "drop"
            if re.search(r"\b(udp|icmp|icmpv6)\b", line) and "tcp" not in line:
                continue
            match = re.search(r"tcp dport (!= )?(\{[^}]*\}|\S+)", line)
            ports = _ranges(match.group(2)) if match else None
            restricted = any(word in line for word in _RESTRICTING_NFT)
            rules.append(Rule(line, verdict, ports, bool(match and match.group(1)), restricted))
    return rules


def _hits(rule: Rule, wanted: PortRange) -> bool:
    """Whether the rule applies to some port of `wanted` (a negated list: to any port outside it)."""
    if rule.ports is None:
        return True
    overlaps = any(low <= wanted[1] and wanted[0] <= high for low, high in rule.ports)
    if not rule.negated:
        return overlaps
    covered = all(any(low <= p <= high for low, high in rule.ports) for p in (wanted[0], wanted[1]))
    return not covered


def _covers(rule: Rule, wanted: PortRange) -> bool:
    """Whether the rule applies to every port of `wanted`."""
    if rule.ports is None:
        return True
    if rule.negated:
        return not any(low <= wanted[1] and wanted[0] <= high for low, high in rule.ports)
    return any(low <= wanted[0] and wanted[1] <= high for low, high in rule.ports)


def _spares_new_connections(rule: Rule) -> bool:
    """An ACCEPT that never takes a new connection from another host: established/related traffic, loopback."""
    text = rule.text.replace(",", " ").upper()
    established = ("ESTABLISHED" in text or "RELATED" in text) and "NEW" not in text
    loopback = re.search(r"(-i|--in-interface|iifname|iif)\s+\"?lo\b", rule.text) is not None
    return established or loopback


def blocked_ports(iptables: str, nft: str, wanted: dict[str, PortRange]) -> list[Blocked]:
    """For each named port range Ray needs, the first rule that drops it (if one does before an ACCEPT)."""
    rules = [r for r in (_iptables_rule(line) for line in iptables.splitlines()) if r is not None]
    rules += _nft_rules(nft)
    found = []
    for name, span in wanted.items():
        restricted_before = False
        for rule in rules:
            if not _hits(rule, span):
                continue
            if rule.verdict == "accept":
                if _spares_new_connections(rule):
                    continue
                if rule.restricted or not _covers(rule, span):
                    restricted_before = True  # it lets some sources (or ports) in: maybe what the cluster needs
                    continue
                break  # accepted from anywhere before any drop
            found.append(Blocked(name, rule.text, rule.restricted or restricted_before))
            break
    return found
