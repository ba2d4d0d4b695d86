"""`doctor --network`: latency, TCP bandwidth both ways and MTU between the head and each worker.

`measure_network` is a library function (the coordinator also runs it before `bench`). Bandwidth comes from
iperf3 when both hosts have it, else from `tcptest.py` run through the same SSH connections (with the host's
python3, else inside the node image). Never prints: progress goes through the callback.
"""

from __future__ import annotations

import json
import queue
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from raycluster_cli.checks.base import CheckResult, Status
from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.host.engine_facts import split_sections
from raycluster_cli.host.parsers import parse_ip_addr, parse_link_mtu
from raycluster_cli.progress import Progress
from raycluster_cli.transport import CommandResult, Transport, quote
from raycluster_cli.transport.fanout import error_message, fanout
from raycluster_cli.transport.pool import Connect

NETWORK_IDS = frozenset({"network", "mtu", "path-mtu"})
TEST_PORT = 5201
Tool = Literal["auto", "iperf3", "builtin"]
_SCRIPT = Path(__file__).with_name("tcptest.py")
_GATHER = (
    "for t in iperf3 ping python3; do command -v $t >/dev/null 2>&1 && echo has-$t; done; echo ---; "
    "ip -o -4 addr show 2>&1; echo ---; ip -o link show 2>&1"
)


@dataclass(frozen=True)
class HostNet:
    tools: frozenset[str]
    interface: str | None  # the interface holding the node IP
    mtu: int | None


def parse_gather(text: str, node_ip: str) -> HostNet:
    tools_text, addr_text, link_text = split_sections(text, 3)
    tools = frozenset(line.removeprefix("has-") for line in tools_text.split() if line.startswith("has-"))
    interface = next((i.name for i in parse_ip_addr(addr_text) if i.address == node_ip), None)
    mtu = parse_link_mtu(link_text).get(interface) if interface else None
    return HostNet(tools, interface, mtu)


@dataclass(frozen=True)
class Ping:
    received: int
    rtt_avg_ms: float | None


def parse_ping(text: str) -> Ping | None:
    """iputils or busybox `ping -c N` summary: packets received and the average round trip."""
    counts = re.search(r"(\d+) packets transmitted, (\d+) (?:packets )?received", text)
    if not counts:
        return None
    rtt = re.search(r"(?:rtt|round-trip) min/avg/max(?:/mdev)? = [\d.]+/([\d.]+)/", text)
    return Ping(int(counts.group(2)), float(rtt.group(1)) if rtt else None)


def parse_iperf3(text: str) -> tuple[float, float | None] | None:
    """(bits/s received, sender's mean RTT in ms or None) from `iperf3 -J` output."""
    try:
        doc = json.loads(text[text.index("{") :])
    except ValueError:
        return None
    end = doc.get("end", {})
    bps = end.get("sum_received", {}).get("bits_per_second")
    if not bps:
        return None
    rtts = [s.get("sender", {}).get("mean_rtt") for s in end.get("streams", [])]
    rtt_us = next((r for r in rtts if r), None)
    return float(bps), (rtt_us / 1000 if rtt_us else None)


def parse_tcptest(text: str) -> dict[str, float] | None:
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict) and {"rtt_ms", "up_bps", "down_bps"} <= set(value):
            return {k: float(value[k]) for k in ("rtt_ms", "up_bps", "down_bps")}
    return None


def mtu_results(inventory: Inventory, nets: dict[str, HostNet | None]) -> list[CheckResult]:
    """One `mtu` result per host: warn where the node IP's interface has another MTU than the head's."""
    head = str(inventory.head_host.address)
    head_net = nets.get(head)
    reference = head_net.mtu if head_net else None
    results = []
    for host in inventory.hosts:
        address = str(host.address)
        net = nets.get(address)
        if net is None:
            continue
        if net.mtu is None:
            results.append(
                CheckResult(
                    "mtu",
                    address,
                    Status.WARN,
                    f"no interface holds {inventory.node_ip(host)} (or no `ip`): MTU not measured",
                    "install iproute2; the node IP must be on one of the host's interfaces",
                )
            )
            continue
        data = {"interface": net.interface, "mtu": net.mtu}
        if reference is not None and net.mtu != reference:
            results.append(
                CheckResult(
                    "mtu",
                    address,
                    Status.WARN,
                    f"MTU {net.mtu} on {net.interface}, the head's is {reference}: large packets may be dropped",
                    f"use one MTU on every host's cluster NIC, e.g. on {address}: ip link set {net.interface} "
                    f"mtu {reference} (and persist it)",
                    data,
                )
            )
        else:
            results.append(CheckResult("mtu", address, Status.OK, f"MTU {net.mtu} on {net.interface}", data=data))
    return results


def _fmt_bps(bps: float) -> str:
    return f"{bps / 1e9:.2f} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.0f} Mbit/s"


NETWORK_PARALLEL = 4  # workers measured at once (they share the head's link: each figure is a share of it)


def measure_network(
    inventory: Inventory,
    connect: Connect,
    progress: Progress = lambda _: None,
    tool: Tool = "auto",
    seconds: float = 2.0,
    parallel: int = NETWORK_PARALLEL,
) -> list[CheckResult]:
    """MTU per host, then latency, bandwidth both ways and path MTU between the head and each worker, up to
    `parallel` workers at once (each pair on its own port of the head)."""
    gathered = fanout(
        inventory.hosts, lambda h: parse_gather(connect(h).run(_GATHER).stdout, inventory.node_ip(h)), what="gather"
    )
    gathered.check_interrupted()
    nets: dict[str, HostNet | None] = {**gathered.value_of()}
    results = mtu_results(inventory, nets)
    head = inventory.head_host
    head_net = nets.get(str(head.address))
    ready = [w for w in inventory.workers if head_net is not None and nets.get(str(w.address)) is not None]
    at_once = max(1, min(parallel, len(ready)))
    ports: queue.Queue[int] = queue.Queue()
    for slot in range(at_once):
        ports.put(TEST_PORT + slot)

    def one(worker: HostConfig) -> list[CheckResult]:
        worker_net, port = nets[str(worker.address)], ports.get()
        assert head_net is not None and worker_net is not None
        try:
            progress(f"measuring the network between {worker.address} and the head")
            pair = _Pair(inventory, connect, worker, head_net, worker_net, port, at_once)
            return [_bandwidth(pair, tool, seconds), _path_mtu(pair)]
        finally:
            ports.put(port)

    measured = fanout(ready, one, max_workers=at_once, what="measure the network")
    measured.check_interrupted()
    found = {str(w.address): o for w, o in measured}
    for worker in inventory.workers:
        address = str(worker.address)
        outcome = found.get(address)
        if outcome is None:
            down = str(head.address) if head_net is None else address
            results.append(
                CheckResult("network", address, Status.WARN, f"not measured: {down} unreachable", "see the ssh check")
            )
        elif outcome.value is None:
            reason = error_message(outcome.error or RuntimeError("no result"), address)
            results.append(CheckResult("network", address, Status.WARN, f"not measured: {reason}", "see --debug"))
        else:
            results += outcome.value
    return results


@dataclass(frozen=True)
class _Pair:
    """One worker measured against the head: their transports' source, what each host has, the head's port."""

    inventory: Inventory
    connect: Connect
    worker: HostConfig
    head_net: HostNet
    worker_net: HostNet
    port: int
    at_once: int  # workers measured at the same time (sharing the head's link)

    @property
    def address(self) -> str:
        return str(self.worker.address)


def _bandwidth(pair: _Pair, tool: Tool, seconds: float) -> CheckResult:
    address, inventory, worker, worker_net = pair.address, pair.inventory, pair.worker, pair.worker_net
    use_iperf = "iperf3" in pair.head_net.tools and "iperf3" in worker_net.tools
    if tool == "iperf3" and not use_iperf:
        return CheckResult("network", address, Status.WARN, "iperf3 is not on both hosts", "install iperf3")
    try:
        figures = _iperf3(pair, seconds) if use_iperf and tool != "builtin" else _builtin(pair, seconds)
    except MeasureError as exc:
        return CheckResult("network", address, Status.WARN, f"not measured: {exc}", exc.hint)
    ping = _ping(pair.connect(worker), inventory.head_address, "-c 5 -i 0.2") if "ping" in worker_net.tools else None
    if ping and ping.rtt_avg_ms is not None:
        if figures.get("rtt_source") == "tcp":
            figures["tcp_rtt_ms"] = figures["rtt_ms"]
        figures["rtt_ms"], figures["rtt_source"] = ping.rtt_avg_ms, "ping"
    figures["concurrent"] = pair.at_once
    data = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
    shared = f", {pair.at_once} workers at once" if pair.at_once > 1 else ""
    rtt = f"rtt {figures['rtt_ms']:.3f} ms" if figures.get("rtt_ms", -1) >= 0 else "rtt not measured"
    message = (
        f"{rtt}; to the head {_fmt_bps(figures['to_head_bps'])}, "
        f"from the head {_fmt_bps(figures['from_head_bps'])} ({figures['tool']}{shared})"
    )
    return CheckResult("network", address, Status.OK, message, data=data)


class MeasureError(Exception):
    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


def _iperf3(pair: _Pair, seconds: float) -> dict[str, Any]:
    """One one-off iperf3 server on the head per direction (it exits after its test, even if we are killed)."""
    inventory, worker, port = pair.inventory, pair.worker, pair.port
    head_t, worker_t = pair.connect(inventory.head_host), pair.connect(worker)
    head = inventory.head_address
    pidfile = f"/tmp/raycluster-iperf3.{port}.pid"
    client = f"iperf3 -c {quote(head)} -p {port} -t {max(1, round(seconds))} -J"  # -t takes whole seconds
    retry = (
        'for i in $(seq 1 50); do out=$({c} 2>&1) && {{ echo "$out"; exit 0; }}; sleep 0.1; done; echo "$out"; exit 1'
    )
    figures = []
    for reverse in ("", " -R"):
        started = head_t.run(f"iperf3 -s -1 -D -B {quote(head)} -p {port} -I {pidfile}")
        if not started.ok:
            raise MeasureError(f"iperf3 server on the head: {started.first_line()}", f"is port {port} free?")
        try:
            figures.append(parse_iperf3(worker_t.run(retry.format(c=client + reverse), timeout=seconds + 60).stdout))
        finally:
            head_t.run(f'kill "$(cat {pidfile})" 2>/dev/null; rm -f {pidfile}')
    forward, backward = figures
    if forward is None or backward is None:
        raise MeasureError(f"iperf3 from {worker.address} to {head}:{port} failed", "check a firewall between them")
    rtt = forward[1] if forward[1] is not None else -1.0
    return {"tool": "iperf3", "rtt_ms": rtt, "to_head_bps": forward[0], "from_head_bps": backward[0]}


def _python(inventory: Inventory, net: HostNet) -> str:
    if "python3" in net.tools:
        return "python3 -"
    return quote("docker", "run", "--rm", "-i", "--network=host", "--entrypoint=python3", inventory.image, "-")


def _builtin(pair: _Pair, seconds: float) -> dict[str, Any]:
    inventory, worker, port = pair.inventory, pair.worker, pair.port
    script = _SCRIPT.read_bytes()
    head = inventory.head_address
    head_t, worker_t = pair.connect(inventory.head_host), pair.connect(worker)
    server: dict[str, CommandResult] = {}
    serve = f"{_python(inventory, pair.head_net)} serve {quote(head)} {port} 60"
    thread = threading.Thread(
        target=lambda: server.setdefault("result", head_t.run(serve, stdin=script, timeout=seconds * 3 + 120)),
        daemon=True,
    )
    thread.start()
    measure = f"{_python(inventory, pair.worker_net)} measure {quote(head)} {port} {seconds:g}"
    client = worker_t.run(measure, stdin=script, timeout=seconds * 3 + 120)
    thread.join(timeout=120)
    figures = parse_tcptest(client.stdout)
    if figures is None:
        problem = server.get("result")
        detail = problem.first_line() if problem is not None and not problem.ok else client.first_line()
        raise MeasureError(f"built-in TCP test from {worker.address} to {head}:{port}: {detail}", "see --debug")
    return {
        "tool": "builtin",
        "rtt_ms": figures["rtt_ms"],
        "rtt_source": "tcp",
        "to_head_bps": figures["up_bps"],
        "from_head_bps": figures["down_bps"],
    }


def _ping(transport: Transport, target: str, options: str) -> Ping | None:
    return parse_ping(transport.run(f"ping -n -q -W 2 {options} {quote(target)}", timeout=60).stdout)


def _path_mtu(pair: _Pair) -> CheckResult:
    """Can full-size packets (don't fragment) go worker → head at the worker's MTU and head → worker at the head's?"""
    inventory, connect, worker, address = pair.inventory, pair.connect, pair.worker, pair.address
    head_net, worker_net = pair.head_net, pair.worker_net
    if "ping" not in head_net.tools or "ping" not in worker_net.tools:
        return CheckResult(
            "path-mtu", address, Status.SKIP, "path MTU not measured: no ping on both hosts", "install iputils-ping"
        )
    if head_net.mtu is None or worker_net.mtu is None:
        return CheckResult("path-mtu", address, Status.SKIP, "path MTU not measured: MTU unknown", "see the mtu check")
    legs = [
        (connect(worker), inventory.head_address, worker_net.mtu, f"{address} → head"),
        (connect(inventory.head_host), inventory.node_ip(worker), head_net.mtu, f"head → {address}"),
    ]
    blocked = []
    for transport, target, mtu, leg in legs:
        ping = _ping(transport, target, f"-c 2 -M do -s {mtu - 28}")
        if ping is None or ping.received == 0:
            blocked.append(f"{leg} at MTU {mtu}")
    data = {"worker_mtu": worker_net.mtu, "head_mtu": head_net.mtu}
    if blocked:
        return CheckResult(
            "path-mtu",
            address,
            Status.WARN,
            "full-size packets do not get through: " + ", ".join(blocked),
            "give every host and switch port on the path the same MTU (jumbo frames everywhere, or nowhere)",
            data,
        )
    return CheckResult("path-mtu", address, Status.OK, "full-size packets pass both ways", data=data)
