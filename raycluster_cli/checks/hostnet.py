"""Network and name checks on one host: NICs, the route to the head, /etc/hosts, ports, the clock."""

from __future__ import annotations

from raycluster_cli.checks.base import CheckContext, Finding, Status
from raycluster_cli.host.containers import LABEL_CLUSTER, LABEL_ROLE
from raycluster_cli.host.engine_facts import parse_containers, running, split_sections
from raycluster_cli.host.firewall import blocked_ports
from raycluster_cli.host.parsers import (
    is_loopback,
    node_addresses,
    parse_clock,
    parse_etc_hosts,
    parse_input_policy,
    parse_ip_addr,
    parse_listening_ports,
    parse_route_source,
    resolve_in_hosts,
)
from raycluster_cli.transport import CommandResult

CLOCK_SKEW_LIMIT_S = 2.0
_NO_IP = "install iproute2 (the `ip` command)"


def _missing_tool(rc: int, err: str) -> bool:
    return rc == 127 or "not found" in err


def head_address(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    head = ctx.inventory.head_address
    if rc != 0:
        return Finding(Status.FAIL, f"cannot list interfaces ({err.strip() or rc})", f"on the head host: {_NO_IP}")
    interfaces = parse_ip_addr(out)
    match = next((i for i in interfaces if i.address == head), None)
    if match:
        return Finding(Status.OK, f"head address {head} is on {match.name}")
    have = ", ".join(f"{i.address} ({i.name})" for i in interfaces if i.scope == "global") or "none"
    return Finding(
        Status.FAIL,
        f"head address {head} is not on any interface of the head host (it has {have})",
        "set head.address to one of the head host's own IPs (the NIC the workers reach)",
    )


def route_to_head(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    head = ctx.inventory.head_address
    if _missing_tool(rc, err):
        return Finding(Status.WARN, "cannot ask the kernel for the route to the head (no `ip`)", _NO_IP)
    source = parse_route_source(out) if rc == 0 else None
    if source is None:
        return Finding(
            Status.FAIL,
            f"no route to the head {head} ({(err or out).strip()[:120] or 'no src'})",
            f"add a route from {ctx.address} to {head}",
        )
    if source != ctx.address:
        return Finding(
            Status.FAIL,
            f"traffic to the head {head} leaves from {source}, not from the inventory address {ctx.address}",
            f"use {source} as this host's address in the inventory, or fix the routes so {ctx.address} is used "
            f"(`ip route get {head}` must say src {ctx.address})",
            {"source": source},
        )
    return Finding(Status.OK, f"reaches the head {head} from {source}", data={"source": source})


def addresses(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    """Several global addresses: Ray may pick the wrong one unless the node IP is pinned (we pin it)."""
    if _missing_tool(rc, err) or rc != 0:
        return Finding(Status.WARN, "cannot list this host's addresses (no `ip`)", _NO_IP)
    found = node_addresses(parse_ip_addr(out))
    listed = ", ".join(f"{i.address} ({i.name})" for i in found)
    data = {"addresses": [i.address for i in found]}
    if len(found) > 1:
        return Finding(
            Status.WARN,
            f"{len(found)} global IPv4 addresses: {listed}",
            f"make sure {ctx.inventory.node_ip(ctx.host)} is the one the other hosts reach "
            "(raycluster pins it with --node-ip-address; set NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME for collectives)",
            data,
        )
    if not found:
        return Finding(Status.WARN, "no global IPv4 address on this host", "check the host's network setup", data)
    return Finding(Status.OK, f"one global IPv4 address: {listed}", data=data)


def etc_hosts(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    own_name, _, hosts_text = out.partition("\n---\n")
    name = ctx.host.hostname or own_name.strip()
    address = ctx.inventory.node_ip(ctx.host)
    if rc != 0 or not name:
        return Finding(Status.FAIL, f"cannot read hostname or /etc/hosts ({err.strip()[:120]})", "check the host")
    resolved = resolve_in_hosts(parse_etc_hosts(hosts_text), name)
    fix = f"on {ctx.address}, make /etc/hosts map '{address} {name}' and remove other lines naming {name}"
    data = {"name": name}
    if resolved is None:
        return Finding(Status.FAIL, f"/etc/hosts does not name {name} (the Ray container's hostname)", fix, data)
    if is_loopback(resolved):
        return Finding(Status.FAIL, f"/etc/hosts maps {name} to loopback {resolved}, not {address}", fix, data)
    if resolved != address:
        return Finding(Status.FAIL, f"/etc/hosts maps {name} to {resolved}, not {address}", fix, data)
    return Finding(Status.OK, f"{name} → {address} in /etc/hosts", data=data)


# The host's name as `hostname` prints it (the kernel's), read by the shell itself where /proc has it.
ETC_HOSTS_COMMAND = (
    'h=; read -r h 2>/dev/null </proc/sys/kernel/hostname; echo "${h:-$(hostname)}"; echo ---; cat /etc/hosts'
)


def ports_command(ctx: CheckContext) -> str:
    """Listening TCP ports, then the INPUT chain's head (iptables, nft): the containers holding Ray's ports come
    from the host's one `docker ps -a` (enginefacts.CONTAINERS), not from a command of their own."""
    return (
        "ss -ltnH; echo ---; iptables -S INPUT 2>&1 | head -n 400; echo ---; "
        "nft list ruleset 2>&1 | grep -E 'table|chain|hook input|accept|drop|reject' | head -n 2000"
    )


def _our_running(ctx: CheckContext, containers: CommandResult, role: str | None = None) -> str:
    labels = {LABEL_CLUSTER: ctx.inventory.cluster, **({LABEL_ROLE: role} if role else {})}
    return "".join(f"{row.id}\n" for row in running(parse_containers(containers), labels))


def head_ports_view(ctx: CheckContext, results: list[CommandResult]) -> CommandResult:
    """`ports_free`'s input: the listening ports, `---`, this cluster's running head container (if any)."""
    ports, containers = results
    listening = split_sections(ports.stdout, 1)[0]
    return CommandResult(0, f"{listening}---\n{_our_running(ctx, containers, 'head')}", ports.stderr)


def worker_ports_view(ctx: CheckContext, results: list[CommandResult]) -> CommandResult:
    """`worker_ports`' input: the listening ports, this cluster's running containers, iptables, nft."""
    ports, containers = results
    listening, iptables, nft = split_sections(ports.stdout, 3)
    ours = _our_running(ctx, containers)
    return CommandResult(ports.rc, f"{listening}---\n{ours}---\n{iptables}---\n{nft}", ports.stderr)


def ports_free(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    listening_text, _, ours = out.partition("\n---\n")
    ray = ctx.inventory.ray
    wanted = {ray.port: "GCS (ray.port)", ray.dashboard_port: "dashboard", ray.client_port: "Ray client"}
    if _missing_tool(rc, err):
        return Finding(Status.WARN, "cannot list listening ports (no `ss`)", "install iproute2 on the head host")
    if ours.strip():
        return Finding(Status.OK, "Ray ports are held by this cluster's running head")
    taken = sorted(p for p in parse_listening_ports(listening_text) if p in wanted)
    if not taken:
        return Finding(Status.OK, "ports " + ", ".join(str(p) for p in sorted(wanted)) + " are free")
    names = ", ".join(f"{p} ({wanted[p]})" for p in taken)
    return Finding(
        Status.FAIL,
        f"port(s) {names} already in use on the head host",
        f"find the process with `ss -ltnp | grep :{taken[0]}` on {ctx.address} and stop it, "
        "or choose other ports under ray: in the inventory",
    )


def _iptables_ports(wanted: dict[str, tuple[int, int]]) -> list[str]:
    return [str(low) if low == high else f"{low}:{high}" for low, high in wanted.values()]


def worker_ports(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    listening_text, ours, iptables, nft = split_sections(out, 4)
    ray = ctx.inventory.ray
    low, high = ray.min_worker_port, ray.max_worker_port
    span = f"{low}-{high}"
    if "ss: " in err or (not listening_text.strip() and _missing_tool(rc, err)):
        return Finding(Status.WARN, f"cannot list listening ports to check {span} (no `ss`)", "install iproute2")
    firewall = parse_input_policy(iptables, nft)
    problems, hints = [], []
    if not ours.strip():
        taken = sorted(p for p in parse_listening_ports(listening_text) if low <= p <= high)
        if taken:
            shown = ", ".join(str(p) for p in taken[:8]) + (f" (+{len(taken) - 8} more)" if len(taken) > 8 else "")
            problems.append(f"{len(taken)} port(s) of the worker range {span} already listening: {shown}")
            hints.append(
                f"stop what listens there (`ss -ltnp | grep :{taken[0]}`) or move ray.min_worker_port/max_worker_port"
            )
    wanted = {f"worker ports {span}": (low, high)}
    if ctx.host.role == "head":
        wanted = {f"{ray.port} (GCS)": (ray.port, ray.port), **wanted}
    blocked = blocked_ports(iptables, nft, wanted)
    for each in blocked:
        maybe = " for some sources (check that the cluster's hosts are let in)" if each.restricted else ""
        problems.append(f"the INPUT rule `{each.rule}` drops {each.name}{maybe}")
    if blocked:
        ports = ", ".join(f"{low}-{high}" if low != high else str(low) for low, high in wanted.values())
        hints.append(
            f"on {ctx.address}, accept TCP {ports} from the cluster's hosts before that rule (e.g. "
            f"`iptables -I INPUT -p tcp -s SUBNET -m multiport --dports {','.join(_iptables_ports(wanted))} -j ACCEPT`)"
        )
    if firewall.drops:
        problems.append(f"{firewall.detail}: Ray's ports must be accepted")
        hints.append(
            f"accept TCP {ray.port}, {ray.dashboard_port}, {ray.client_port} and {span} from the other hosts "
            "(Ray also uses random node-manager and object-manager ports)"
        )
    data = {"range": span, "firewall_checked": firewall.checked, "blocked": [b.__dict__ for b in blocked]}
    if problems:
        status = Status.FAIL if any(not b.restricted for b in blocked) else Status.WARN
        return Finding(status, "; ".join(problems), "; ".join(hints), data)
    held = " (in use by this cluster's running node, not checked)" if ours.strip() else ""
    firewall_note = "" if firewall.checked else "; firewall not readable"
    return Finding(Status.OK, f"worker ports {span} free{held}{firewall_note}", data=data)


def clock(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    reading = parse_clock(out) if rc == 0 else None
    if reading is None:
        return Finding(Status.WARN, f"cannot read the host's clock ({err.strip()[:80] or 'no output'})", "check `date`")
    data = {"skew_s": round(reading.skew_s, 3), "uncertainty_s": round(reading.uncertainty_s, 3)}
    if abs(reading.skew_s) - reading.uncertainty_s > CLOCK_SKEW_LIMIT_S:
        direction = "ahead of" if reading.skew_s > 0 else "behind"
        return Finding(
            Status.WARN,
            f"clock is {abs(reading.skew_s):.1f}s {direction} this machine's (limit {CLOCK_SKEW_LIMIT_S:g}s)",
            f"run NTP on {ctx.address} (timedatectl set-ntp true, or chrony) so logs and timeouts line up",
            data,
        )
    return Finding(Status.OK, f"clock within {abs(reading.skew_s):.2f}s ±{reading.uncertainty_s:.2f}s", data=data)
