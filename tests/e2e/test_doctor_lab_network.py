"""doctor's network checks on the real lab: a second network that steals a worker's source address, the
name × host matrix, the worker port range and firewall rules on Ray's ports, clock skew, and `doctor --network` figures and MTU mismatches."""

from __future__ import annotations

import ipaddress
import subprocess
from collections.abc import Iterator

import pytest

from raycluster_cli.lab import hosts as lab

from .conftest import DOCKER, IP1, IP2, IP3, UNUSED_IP, Lab
from .findings import failed, finding, problems, warned

pytestmark = pytest.mark.lab
IMAGE = lab.NODE_IMAGE


def second_subnet() -> ipaddress.IPv4Network:
    """The lab subnet with its second octet plus one: 10.77.0.0/24 → 10.78.0.0/24."""
    net = ipaddress.ip_network(lab.DEFAULT_SUBNET)
    assert isinstance(net, ipaddress.IPv4Network)
    return ipaddress.IPv4Network((int(net.network_address) + (1 << 16), net.prefixlen))


def docker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=120)


def test_healthy_lab_runs_every_check_without_failure(lab_hosts: Lab) -> None:
    code, doc, _ = lab_hosts.cli("doctor")
    assert code == 0, failed(doc)
    ids = {(c["host"], c["id"]) for c in doc["checks"]}
    for host in (IP1, IP2, IP3):
        for check in ("docker", "image", "image-runtime", "addresses", "worker-ports", "etc-hosts", "clock"):
            assert (host, check) in ids
        for check in ("shm", "memory", "disk", "stale-ray", "names"):
            assert (host, check) in ids
    assert finding(doc, IP2, "image-runtime")["data"]["ray"] == "2.60.0"


@pytest.fixture
def second_network(lab_hosts: Lab) -> Iterator[str]:
    """A second Docker network on lab-h2 plus a route that makes the kernel leave towards the head from it."""
    name = f"{lab.LAB_NAME}-second"
    docker("network", "rm", name)  # one left by an earlier, interrupted session would make the create fail
    subnet = ipaddress.IPv4Network(lab.free_subnet(str(second_subnet()), name))  # another, if a network holds it
    made = docker("network", "create", "--subnet", str(subnet), "--label", f"{lab.LAB_LABEL}={lab.LAB_NAME}", name)
    assert made.returncode == 0, made.stderr
    host = lab_hosts.host("lab-h2").name
    # Docker adds the new address to /etc/hosts on connect and drops every line of the name on disconnect.
    hosts_file = lab_hosts.sh("lab-h2", "cat /etc/hosts")
    try:
        second_ip = str(subnet.network_address + 12)
        joined = docker("network", "connect", "--ip", second_ip, name, host)
        assert joined.returncode == 0, joined.stderr
        device = lab_hosts.sh("lab-h2", f"ip -o -4 addr show | awk '$4 ~ /^{second_ip}\\// {{print $2}}'").strip()
        assert device, "the second network's interface did not appear"
        lab_hosts.sh("lab-h2", f"ip route add {IP1}/32 dev {device} src {second_ip}")
        yield second_ip
    finally:
        lab_hosts.sh_result("lab-h2", f"ip route del {IP1}/32")
        docker("network", "disconnect", "--force", name, host)
        docker("network", "rm", name)
        lab_hosts.sh("lab-h2", f"cat > /etc/hosts <<'EOF'\n{hosts_file}EOF")


def test_second_network_steals_the_source_address(lab_hosts: Lab, second_network: str) -> None:
    code, doc, _ = lab_hosts.cli("doctor")
    assert code == 1
    assert failed(doc) == [(IP2, "route-to-head")]
    bad = finding(doc, IP2, "route-to-head")
    assert f"leaves from {second_network}, not from the inventory address {IP2}" in bad["message"]
    assert f"src {IP2}" in bad["hint"]
    several = finding(doc, IP2, "addresses")
    assert several["status"] == "warn" and IP2 in several["message"] and second_network in several["message"]


def test_route_network_and_hosts_file_are_repaired_after_the_test(lab_hosts: Lab) -> None:
    assert f"src {IP2}" in lab_hosts.sh("lab-h2", f"ip route get {IP1}")
    assert docker("network", "inspect", f"{lab.LAB_NAME}-second").returncode != 0
    assert f"{IP2}\tlab-h2" in lab_hosts.sh("lab-h2", "cat /etc/hosts")


@pytest.fixture
def h3_hosts_file(lab_hosts: Lab) -> Iterator[Lab]:
    original = lab_hosts.sh("lab-h3", "cat /etc/hosts")
    yield lab_hosts
    lab_hosts.sh("lab-h3", f"cat > /etc/hosts <<'EOF'\n{original}EOF")


def test_names_matrix_names_the_host_with_the_wrong_line(h3_hosts_file: Lab) -> None:
    # lab-h3 still maps its own name right, but says lab-h1 (the head) lives elsewhere.
    h3_hosts_file.sh("lab-h3", f"printf '# edited\\n{UNUSED_IP}\\tlab-h1 head\\n{IP2} lab-h2\\n' >> /etc/hosts")
    code, doc, _ = h3_hosts_file.cli("doctor")
    assert code == 1
    assert failed(doc) == [(IP3, "names")]
    bad = finding(doc, IP3, "names")
    assert f"lab-h1 (host {IP1}) → {UNUSED_IP}, should be {IP1}" in bad["message"]
    assert f"'{IP1} lab-h1'" in bad["hint"]
    assert bad["data"]["resolves"] == {"lab-h1": UNUSED_IP, "lab-h2": IP2}


def test_worker_port_range_in_use_warns(lab_hosts: Lab) -> None:
    squatter = f"docker run -d --name range-squatter --network host {IMAGE} python -m http.server 12345"
    lab_hosts.sh("lab-h2", squatter)
    try:
        lab_hosts.sh(
            "lab-h2", "for i in $(seq 100); do ss -ltnH | grep -q ':12345 ' && exit 0; sleep 0.1; done; exit 1"
        )
        code, doc, _ = lab_hosts.cli("doctor")
        assert code == 0, failed(doc)
        assert warned(doc) == [(IP2, "worker-ports")], problems(doc)
        assert "12345" in finding(doc, IP2, "worker-ports")["message"]
    finally:
        lab_hosts.sh("lab-h2", "docker rm -f range-squatter")


GCS_DROP = "INPUT -p tcp -m tcp --dport 6379 -j DROP"
RANGE_REJECT = "INPUT -p tcp -m multiport --dports 8080,12000:12100 -j REJECT --reject-with icmp-port-unreachable"
SOME_SOURCES = "INPUT -s 198.51.100.0/24 -p tcp -m tcp --dport 10002:19999 -j DROP"


@pytest.fixture
def firewalls(lab_hosts: Lab) -> Iterator[None]:
    """Real INPUT rules in each lab host's network (where its Ray container listens): the head drops the GCS
    port, lab-h2 rejects part of the worker range, lab-h3 drops the range for one foreign subnet only."""
    rules = {"lab-h1": GCS_DROP, "lab-h2": RANGE_REJECT, "lab-h3": SOME_SOURCES}
    for hostname, rule in rules.items():
        lab_hosts.sh(hostname, f"iptables -A {rule}")
    try:
        yield
    finally:
        for hostname, rule in rules.items():
            lab_hosts.sh_result(hostname, f"while iptables -D {rule} 2>/dev/null; do :; done")


def test_firewall_rules_that_drop_rays_ports_fail_worker_ports_naming_the_rule(lab_hosts: Lab, firewalls: None) -> None:
    """issue 33: doctor's firewall finding on the lab (it used to see only a DROP policy, in the first 5 lines)."""
    code, doc, _ = lab_hosts.cli("doctor")
    assert code == 1
    assert failed(doc) == sorted([(IP1, "worker-ports"), (IP2, "worker-ports")]), problems(doc)
    assert warned(doc) == [(IP3, "worker-ports")], problems(doc)
    head = finding(doc, IP1, "worker-ports")
    assert f"the INPUT rule `-A {GCS_DROP}` drops 6379 (GCS)" in head["message"], head
    assert f"on {IP1}, accept TCP 6379, 10002-19999" in head["hint"]
    assert "worker ports 10002-19999" in finding(doc, IP2, "worker-ports")["message"]
    assert "for some sources" in finding(doc, IP3, "worker-ports")["message"]


def test_clock_skew_warns(lab_hosts: Lab) -> None:
    # The lab hosts share this machine's kernel clock: a `date` in front of the real one plays a host 30 s ahead.
    shim = '#!/bin/sh\nexec /bin/date -d "@$(( $(/bin/date +%s) + 30 ))" "$@"\n'
    with lab_hosts.shim("lab-h3", "date", shim):
        code, doc, _ = lab_hosts.cli("doctor")
    assert code == 0, failed(doc)
    assert warned(doc) == [(IP3, "clock")]
    skew = finding(doc, IP3, "clock")
    assert "ahead of" in skew["message"] and 28 < skew["data"]["skew_s"] < 32


@pytest.mark.parametrize("tool", ["auto", "builtin"])
def test_network_figures_for_every_worker(lab_hosts: Lab, tool: str) -> None:
    code, doc, err = lab_hosts.cli("doctor", "--network", "--network-tool", tool)
    assert code == 0, failed(doc)
    for worker in (IP2, IP3):
        net = finding(doc, worker, "network")
        assert net["status"] == "ok", net
        data = net["data"]
        assert data["tool"] == ("iperf3" if tool == "auto" else "builtin")  # the lab hosts have iperf3
        assert 0 < data["rtt_ms"] < 50
        assert data["to_head_bps"] > 10e6 and data["from_head_bps"] > 10e6
        assert "Mbit/s" in net["message"] or "Gbit/s" in net["message"]
        assert finding(doc, worker, "path-mtu")["status"] == "ok"
    assert {finding(doc, h, "mtu")["data"]["mtu"] for h in (IP1, IP2, IP3)} == {1500}
    assert "measuring the network" in err


@pytest.fixture
def small_mtu(lab_hosts: Lab) -> Iterator[None]:
    before = lab_hosts.sh("lab-h3", "cat /sys/class/net/eth0/mtu").strip()
    lab_hosts.sh("lab-h3", "ip link set eth0 mtu 1400")
    try:
        yield
    finally:
        lab_hosts.sh("lab-h3", f"ip link set eth0 mtu {before}")


def test_mtu_mismatch_warns_on_that_host(lab_hosts: Lab, small_mtu: None) -> None:
    code, doc, _ = lab_hosts.cli("doctor", "--network")
    assert code == 0, failed(doc)
    assert warned(doc) == [(IP3, "mtu"), (IP3, "path-mtu")]
    mtu = finding(doc, IP3, "mtu")
    assert "MTU 1400 on eth0, the head's is 1500" in mtu["message"] and "mtu 1500" in mtu["hint"]
    assert "head → " + IP3 + " at MTU 1500" in finding(doc, IP3, "path-mtu")["message"]
