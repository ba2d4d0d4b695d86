"""The pure parsers, from recorded command output (including odd cases)."""

from pathlib import Path

from raycluster_cli.host.parsers import (
    is_loopback,
    parse_etc_hosts,
    parse_ip_addr,
    parse_listening_ports,
    parse_route_source,
    resolve_in_hosts,
)

RECORDED = Path(__file__).parent / "recorded"


def test_ip_addr_several_nics_and_ipv6_lines() -> None:
    interfaces = parse_ip_addr((RECORDED / "ip_addr_multi_nic.txt").read_text())
    assert [(i.name, i.address, i.prefix, i.scope) for i in interfaces] == [
        ("lo", "127.0.0.1", 8, "host"),
        ("eno1", "192.0.2.11", 24, "global"),
        ("ib0", "198.51.100.11", 24, "global"),
        ("docker0", "172.17.0.1", 16, "global"),
        ("eth1", "203.0.113.5", 24, "global"),
    ]


def test_ip_addr_empty_output() -> None:
    assert parse_ip_addr("") == []


def test_etc_hosts_debian_default_maps_hostname_to_loopback_first() -> None:
    entries = parse_etc_hosts((RECORDED / "etc_hosts_debian_default.txt").read_text())
    # glibc returns the first matching line: the 127.0.1.1 one, although a later line is right.
    assert resolve_in_hosts(entries, "gpu-node-2") == "127.0.1.1"
    assert is_loopback("127.0.1.1")


def test_etc_hosts_comments_aliases_tabs_and_case() -> None:
    entries = parse_etc_hosts((RECORDED / "etc_hosts_good.txt").read_text())
    assert resolve_in_hosts(entries, "gpu-node-1") == "192.0.2.11"
    assert resolve_in_hosts(entries, "gpu-node-1.example.internal") == "192.0.2.11"
    assert resolve_in_hosts(entries, "gpu-node-2") == "192.0.2.12"  # case-insensitive, first wins
    assert resolve_in_hosts(entries, "head") is None  # a comment is not an alias
    assert resolve_in_hosts(entries, "localhost") == "127.0.0.1"  # IPv6 lines never answer


def test_route_source() -> None:
    assert parse_route_source("192.0.2.11 dev eth0 src 192.0.2.12 uid 0 \n    cache \n") == "192.0.2.12"
    assert parse_route_source("192.0.2.11 via 198.51.100.1 dev ib0 src 198.51.100.12 uid 0") == "198.51.100.12"
    assert parse_route_source("RTNETLINK answers: Network is unreachable") is None


def test_listening_ports_ipv4_ipv6_wildcards() -> None:
    text = (
        "LISTEN 0      4096      10.77.0.11:6379       0.0.0.0:*\n"
        "LISTEN 0      128          0.0.0.0:22         0.0.0.0:*\n"
        "LISTEN 0      128             [::]:8265          [::]:*\n"
        "LISTEN 0      511                *:10001            *:*\n"
        "ESTAB  0      0         10.77.0.11:22     10.77.0.1:5050\n"
    )
    assert parse_listening_ports(text) == {6379, 22, 8265, 10001}
    assert parse_listening_ports("") == set()
