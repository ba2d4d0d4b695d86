"""Parsers behind the network and name checks, from recorded output (several NICs, bridges, IPv6-only, firewalls)."""

from pathlib import Path

import pytest

from raycluster_cli.host.engine_facts import split_sections
from raycluster_cli.host.parsers import (
    is_container_bridge,
    node_addresses,
    parse_clock,
    parse_input_policy,
    parse_ip_addr,
    parse_link_mtu,
    parse_listening_ports,
)

RECORDED = Path(__file__).parent / "recorded"


def test_node_addresses_leave_out_bridges_and_keep_secondaries() -> None:
    found = node_addresses(parse_ip_addr((RECORDED / "ip_addr_bridges.txt").read_text()))
    assert [(i.name, i.address) for i in found] == [("eno1", "192.0.2.12"), ("eno1", "192.0.2.112")]


def test_node_addresses_several_nics() -> None:
    found = node_addresses(parse_ip_addr((RECORDED / "ip_addr_multi_nic.txt").read_text()))
    assert [i.address for i in found] == ["192.0.2.11", "198.51.100.11", "203.0.113.5"]


def test_ipv6_only_host_has_no_ipv4_address() -> None:
    assert parse_ip_addr((RECORDED / "ip_addr_ipv6_only.txt").read_text()) == []


@pytest.mark.parametrize("name", ["docker0", "br-5f2c1d0e9a7b", "veth12ab", "virbr0", "cni0", "lo", "flannel.1"])
def test_container_bridges(name: str) -> None:
    assert is_container_bridge(name)


@pytest.mark.parametrize("name", ["eth0", "eno1", "ib0", "bond0", "enp1s0f0"])
def test_real_nics(name: str) -> None:
    assert not is_container_bridge(name)


def test_link_mtu_with_peer_suffix() -> None:
    mtus = parse_link_mtu((RECORDED / "ip_link_lab.txt").read_text())
    assert mtus == {"lo": 65536, "eth0": 1500}
    assert parse_link_mtu("") == {}


def test_split_sections_pads_missing_ones() -> None:
    assert split_sections("a\n---\nb\n", 3) == ["a\n", "b\n", ""]
    assert split_sections("x --- y\n", 2) == ["x --- y\n", ""]


def test_worker_range_listeners_ipv4_ipv6_and_wildcard() -> None:
    ports = parse_listening_ports((RECORDED / "ss_worker_range.txt").read_text())
    assert ports == {22, 10005, 12345, 20000}


def test_input_policy_drop_from_iptables_and_nft() -> None:
    dropped = parse_input_policy((RECORDED / "iptables_drop.txt").read_text(), "")
    assert dropped.checked and dropped.drops and "DROP" in dropped.detail
    nft = parse_input_policy("iptables: command not found\n", (RECORDED / "nft_drop.txt").read_text())
    assert nft.drops and "nftables" in nft.detail


def test_input_policy_accept_and_unreadable() -> None:
    assert parse_input_policy("-P INPUT ACCEPT\n-A INPUT -j ACCEPT\n", "") == parse_input_policy(
        "-P INPUT ACCEPT\n", ""
    )
    accept = parse_input_policy("-P INPUT ACCEPT\n", "sh: 1: nft: not found\n")
    assert accept.checked and not accept.drops
    denied = parse_input_policy(
        "iptables v1.8.9 (nf_tables): Could not fetch rule set generation id: Permission denied (you must be root)\n",
        "Operation not permitted\n",
    )
    assert not denied.checked and not denied.drops


def test_clock_skew_from_the_midpoint() -> None:
    reading = parse_clock("operator 1000.000000 1000.200000\n1003.100000000\n")
    assert reading is not None
    assert reading.skew_s == pytest.approx(3.0)
    assert reading.uncertainty_s == pytest.approx(0.1)


def test_clock_busybox_without_nanoseconds_and_garbage() -> None:
    reading = parse_clock("operator 1000.0 1000.0\n1000.%N\n")
    assert reading is not None and reading.skew_s == pytest.approx(0.0) and reading.uncertainty_s == 1.0
    assert parse_clock("operator 1 2\ndate: invalid\n") is None
    assert parse_clock("1000.1\n") is None
