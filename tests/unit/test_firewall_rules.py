"""Which of Ray's ports a host's INPUT rules drop (host/firewall.py), and `doctor`'s worker-ports check on them:
the rules as `iptables -S INPUT` and `nft list ruleset` print them."""

from __future__ import annotations

from raycluster_cli.checks import Status
from raycluster_cli.host.firewall import blocked_ports

from .test_checks import PORTS
from .test_checks_more import HEAD, W2, on, run

WANTED = {"6379 (GCS)": (6379, 6379), "worker ports 10002-19999": (10002, 19999)}
BASE = "-P INPUT ACCEPT\n-A INPUT -i lo -j ACCEPT\n-A INPUT -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT\n"


def test_a_rule_dropping_the_gcs_port_is_found_and_others_pass() -> None:
    rules = BASE + "-A INPUT -p tcp -m tcp --dport 6379 -j DROP\n-A INPUT -p udp -m udp --dport 10005 -j DROP\n"
    [blocked] = blocked_ports(rules, "", WANTED)
    assert blocked.name == "6379 (GCS)" and not blocked.restricted
    assert blocked.rule == "-A INPUT -p tcp -m tcp --dport 6379 -j DROP"


def test_multiport_reject_of_part_of_the_worker_range_and_a_catch_all_drop() -> None:
    reject = "-A INPUT -p tcp -m multiport --dports 8080,12000:12100 -j REJECT --reject-with icmp-port-unreachable"
    [worker] = blocked_ports(BASE + reject + "\n", "", WANTED)
    assert worker.name.startswith("worker ports") and "REJECT" in worker.rule
    both = blocked_ports(BASE + "-A INPUT -p tcp --dport 22 -j ACCEPT\n-A INPUT -j DROP\n", "", WANTED)
    assert [b.name for b in both] == list(WANTED) and all(b.rule == "-A INPUT -j DROP" for b in both)


def test_an_accept_before_the_drop_decides_and_a_source_makes_it_restricted() -> None:
    accepted = BASE + "-A INPUT -p tcp -m multiport --dports 6379,10002:19999 -j ACCEPT\n-A INPUT -j DROP\n"
    assert blocked_ports(accepted, "", WANTED) == []
    subnet = BASE + "-A INPUT -s 10.0.0.0/24 -j ACCEPT\n-A INPUT -j DROP\n"
    assert {b.restricted for b in blocked_ports(subnet, "", WANTED)} == {True}
    from_one = BASE + "-A INPUT ! -s 10.0.0.5/32 -p tcp -m tcp --dport 6379 -j DROP\n"
    [gcs] = blocked_ports(from_one, "", WANTED)
    assert gcs.restricted
    negated = BASE + "-A INPUT -p tcp -m tcp ! --dport 22 -j DROP\n"
    assert len(blocked_ports(negated, "", WANTED)) == 2
    assert blocked_ports(BASE + "-A INPUT -p tcp -m tcp ! --dport 1:65535 -j DROP\n", "", WANTED) == []


def test_nft_input_chains_only() -> None:
    ruleset = """table inet filter {
	chain input {
		type filter hook input priority filter; policy accept;
		ct state established,related accept
		iifname "lo" accept
		tcp dport { 22, 8265 } accept
		tcp dport { 6379, 10002-19999 } drop
	}
	chain forward {
		type filter hook forward priority filter; policy accept;
		tcp dport 6379 drop
	}
}
"""
    found = blocked_ports("iptables: command not found\n", ruleset, WANTED)
    assert [b.name for b in found] == list(WANTED) and all("drop" in b.rule for b in found)
    forward_only = ruleset.replace("tcp dport { 6379, 10002-19999 } drop", "")
    assert blocked_ports("", forward_only, WANTED) == []


def test_worker_ports_fails_on_the_head_naming_the_rule_and_warns_for_a_restricted_one(example_yaml: str) -> None:
    gcs = BASE + "-A INPUT -p tcp -m tcp --dport 6379 -j DROP\n"
    results = run(example_yaml, on(HEAD, "node-1", **{PORTS: f"---\n{gcs}---\n"}))
    head = results[(HEAD, "worker-ports")]
    assert head.status == Status.FAIL
    assert "the INPUT rule `-A INPUT -p tcp -m tcp --dport 6379 -j DROP` drops 6379 (GCS)" in head.message
    assert f"on {HEAD}, accept TCP 6379, 10002-19999" in head.hint and "--dports 6379,10002:19999" in head.hint
    # the GCS port is the head's only: on a worker the same rule is fine
    assert run(example_yaml, on(W2, "node-2", **{PORTS: f"---\n{gcs}---\n"}))[(W2, "worker-ports")].status == Status.OK
    some = BASE + "-A INPUT -s 198.51.100.0/24 -p tcp -m tcp --dport 10002:19999 -j DROP\n"
    warn = run(example_yaml, on(W2, "node-2", **{PORTS: f"---\n{some}---\n"}))[(W2, "worker-ports")]
    assert warn.status == Status.WARN and "for some sources" in warn.message
