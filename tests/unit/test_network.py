"""`doctor --network` from recorded output: parsers, and measure_network over faked hosts."""

import json
import threading
from pathlib import Path

import pytest

from raycluster_cli.checks import CheckResult, Status
from raycluster_cli.checks.network import (
    HostNet,
    measure_network,
    mtu_results,
    parse_gather,
    parse_iperf3,
    parse_ping,
    parse_tcptest,
)
from raycluster_cli.config import inventory
from raycluster_cli.config.inventory import HostConfig
from raycluster_cli.transport.base import CommandResult
from raycluster_cli.transport.fake import FakeTransport

RECORDED = Path(__file__).parent / "recorded"
HEAD, W2, W3 = "192.0.2.11", "192.0.2.12", "192.0.2.13"


def gather(address: str, tools: str = "has-iperf3\nhas-ping\n", mtu: int = 1500) -> str:
    return (
        f"{tools}---\n2: eth0    inet {address}/24 brd 192.0.2.255 scope global eth0\\       valid_lft forever\n"
        f"---\n1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536 qdisc noqueue state UNKNOWN\n"
        f"2: eth0@if85: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu {mtu} qdisc noqueue state UP\n"
    )


def test_parse_gather_tools_interface_and_mtu() -> None:
    net = parse_gather(gather(W2, "has-ping\nhas-python3\n", 9000), W2)
    assert net == HostNet(frozenset({"ping", "python3"}), "eth0", 9000)
    assert parse_gather("---\nsh: 1: ip: not found\n---\nsh: 1: ip: not found\n", W2) == HostNet(
        frozenset(), None, None
    )


def test_parse_ping_iputils_busybox_and_loss() -> None:
    ok = parse_ping((RECORDED / "ping_ok.txt").read_text())
    assert ok is not None and ok.received == 2 and ok.rtt_avg_ms == pytest.approx(0.061)
    busybox = parse_ping((RECORDED / "ping_busybox_ok.txt").read_text())
    assert busybox is not None and busybox.rtt_avg_ms == pytest.approx(0.152)
    lost = parse_ping((RECORDED / "ping_lost_busybox.txt").read_text())
    assert lost is not None and lost.received == 0 and lost.rtt_avg_ms is None
    assert parse_ping("ping: sendmsg: Message too long\n") is None


def test_parse_iperf3_recorded_and_error() -> None:
    parsed = parse_iperf3((RECORDED / "iperf3_client.json").read_text())
    assert parsed is not None
    bps, rtt = parsed
    assert bps == pytest.approx(7474503311.455522)
    assert rtt == pytest.approx(0.198)
    assert parse_iperf3('{"start": {}, "error": "unable to connect to server: Connection refused"}') is None
    assert parse_iperf3("iperf3: error - unable to connect\n") is None


def test_parse_tcptest_last_json_line() -> None:
    out = 'Unable to find image locally\n{"rtt_ms": 0.1, "up_bps": 1e9, "down_bps": 2e9}\n'
    assert parse_tcptest(out) == {"rtt_ms": 0.1, "up_bps": 1e9, "down_bps": 2e9}
    assert parse_tcptest("Traceback ...\nConnectionRefusedError\n") is None


def test_mtu_warns_on_the_host_that_differs() -> None:
    inv = inventory.parse(EXAMPLE)
    nets = {
        HEAD: HostNet(frozenset(), "eth0", 9000),
        W2: HostNet(frozenset(), "eth0", 9000),
        W3: HostNet(frozenset(), "ens5", 1500),
    }
    results = {r.host: r for r in mtu_results(inv, nets)}
    assert results[W2].status == Status.OK
    assert results[W3].status == Status.WARN
    assert "MTU 1500 on ens5, the head's is 9000" in results[W3].message
    assert "ip link set ens5 mtu 9000" in results[W3].hint
    assert results[W3].data == {"interface": "ens5", "mtu": 1500}


EXAMPLE = """
cluster: demo
image: raycluster/node:0.1.0
hosts:
  - {address: 192.0.2.11, role: head}
  - {address: 192.0.2.12, role: worker}
  - {address: 192.0.2.13, role: worker}
"""
IPERF = (RECORDED / "iperf3_client.json").read_text()
PING = (RECORDED / "ping_ok.txt").read_text()
LOST = (RECORDED / "ping_lost_busybox.txt").read_text()


def measure(
    tables: dict[str, dict[str, CommandResult | str]], tool: str = "auto"
) -> dict[tuple[str, str], CheckResult]:
    inv = inventory.parse(EXAMPLE)
    fakes = {address: FakeTransport(address, table) for address, table in tables.items()}

    def connect(host: HostConfig) -> FakeTransport:
        return fakes[str(host.address)]

    progress: list[str] = []
    results = measure_network(inv, connect, progress.append, tool)  # type: ignore[arg-type]
    assert len(progress) == 2
    return {(r.host, r.id): r for r in results}


def test_iperf3_figures_and_full_path_mtu() -> None:
    head = {r"^for t in": gather(HEAD), r"^iperf3 -s": "", r"^kill": "", r"^ping .* -M do": PING}
    worker = {r"^for t in": gather(W2), r"^for i in": IPERF, r"^ping ": PING}
    results = measure({HEAD: head, W2: worker, W3: {**worker, r"^for t in": gather(W3)}})
    net = results[(W2, "network")]
    assert net.status == Status.OK
    assert net.data["tool"] == "iperf3" and net.data["to_head_bps"] > 1e9
    assert net.data["rtt_source"] == "ping" and net.data["rtt_ms"] == pytest.approx(0.061)
    assert "Gbit/s" in net.message
    assert results[(W3, "path-mtu")].status == Status.OK


def test_builtin_when_a_host_lacks_iperf3_and_path_blocked_one_way() -> None:
    figures = json.dumps({"rtt_ms": 0.2, "up_bps": 9.4e8, "down_bps": 9.1e8})
    head = {r"^for t in": gather(HEAD, "has-ping\n"), r"^docker run .* serve": "", r"^ping .* -M do": LOST}
    worker = {r"^for t in": gather(W2), r"^docker run .* measure": figures + "\n", r"^ping ": PING}
    results = measure({HEAD: head, W2: worker, W3: {**worker, r"^for t in": gather(W3)}})
    net = results[(W2, "network")]
    assert net.data["tool"] == "builtin" and net.data["tcp_rtt_ms"] == 0.2
    assert "940 Mbit/s" in net.message
    blocked = results[(W2, "path-mtu")]
    assert blocked.status == Status.WARN
    assert "head → 192.0.2.12 at MTU 1500" in blocked.message


def test_host_python_is_used_when_present_and_no_ping_means_not_measured() -> None:
    figures = json.dumps({"rtt_ms": 0.3, "up_bps": 1e8, "down_bps": 1e8})
    head = {r"^for t in": gather(HEAD, "has-python3\n"), r"^python3 - serve": ""}
    worker = {r"^for t in": gather(W2, "has-python3\n"), r"^python3 - measure": figures}
    results = measure({HEAD: head, W2: worker, W3: {**worker, r"^for t in": gather(W3, "has-python3\n")}}, "builtin")
    assert results[(W2, "network")].data["rtt_ms"] == 0.3
    skipped = results[(W2, "path-mtu")]
    assert skipped.status == Status.SKIP and "not measured" in skipped.message


def test_failed_measurement_is_a_warning_with_a_reason() -> None:
    head = {r"^for t in": gather(HEAD), r"^iperf3 -s": CommandResult(1, "", "iperf3: error - unable to start listener")}
    worker = {r"^for t in": gather(W2), r"^ping ": PING}
    results = measure({HEAD: head, W2: worker, W3: {**worker, r"^for t in": gather(W3)}})
    warn = results[(W2, "network")]
    assert warn.status == Status.WARN and "unable to start listener" in warn.message


FIVE = EXAMPLE + "  - {address: 192.0.2.14, role: worker}\n  - {address: 192.0.2.15, role: worker}\n"


class _Meter:
    """How many iperf3 clients run at once (the most seen), and on which ports of the head."""

    def __init__(self, parallel: int) -> None:
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(parallel)  # `parallel` clients at once pass it; fewer time out
        self.now = self.most = 0
        self.ports: set[str] = set()


class _Client(FakeTransport):
    def __init__(self, address: str, table: dict[str, CommandResult | str], meter: _Meter) -> None:
        super().__init__(address, table)
        self.meter = meter

    def answer(self, command: str) -> CommandResult:
        if command.startswith("for i in"):
            meter = self.meter
            with meter.lock:
                meter.now += 1
                meter.most = max(meter.most, meter.now)
                meter.ports.add(command.split(" -p ")[1].split()[0])
            try:
                meter.barrier.wait(timeout=10)
            finally:
                with meter.lock:
                    meter.now -= 1
        return super().answer(command)


def test_workers_are_measured_in_parallel_up_to_the_bound_each_on_its_own_port() -> None:
    inv = inventory.parse(FIVE)
    meter = _Meter(2)
    head = {r"^for t in": gather(HEAD), r"^iperf3 -s": "", r"^kill": "", r"^ping .* -M do": PING}
    workers = [str(h.address) for h in inv.workers]
    fakes: dict[str, FakeTransport] = {HEAD: FakeTransport(HEAD, head)}
    for address in workers:
        fakes[address] = _Client(address, {r"^for t in": gather(address), r"^for i in": IPERF, r"^ping ": PING}, meter)
    results = measure_network(inv, lambda h: fakes[str(h.address)], tool="iperf3", parallel=2)
    assert meter.most == 2 and meter.ports == {"5201", "5202"}
    network = [r for r in results if r.id == "network"]
    assert [r.host for r in network] == workers  # in the inventory's order
    assert all(r.status == Status.OK and r.data["concurrent"] == 2 for r in network), [r.message for r in network]
    assert all("2 workers at once" in r.message for r in network)
    assert [r.host for r in results if r.id == "path-mtu"] == workers
