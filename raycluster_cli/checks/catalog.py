"""The preflight checks that `doctor` and `up` run on every host."""

from __future__ import annotations

from ..transport import quote
from .base import Check, CheckContext, Finding, Status
from .parsers import (
    is_loopback,
    parse_etc_hosts,
    parse_ip_addr,
    parse_listening_ports,
    parse_route_source,
    resolve_in_hosts,
)

IMAGE_ID_CHECK = "image"


def _docker(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    if rc == 0 and out.strip():
        return Finding(Status.OK, f"Docker engine {out.strip()} answers")
    text = (err or out).strip()
    if rc == 127 or "not found" in text:
        return Finding(Status.FAIL, "docker is not installed", f"install Docker Engine on {ctx.address}")
    if "permission denied" in text.lower():
        return Finding(
            Status.FAIL,
            f"user {ctx.inventory.ssh_for(ctx.host).user} may not use Docker",
            f"on {ctx.address}: usermod -aG docker {ctx.inventory.ssh_for(ctx.host).user} (then log in again)",
        )
    return Finding(
        Status.FAIL,
        f"Docker daemon does not answer ({text.splitlines()[-1] if text else f'exit {rc}'})",
        f"start it on {ctx.address}: systemctl start docker",
    )


def _image(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    image = ctx.inventory.image
    if rc == 0 and out.strip().startswith("sha256:"):
        image_id = out.strip()
        return Finding(Status.OK, f"{image} present ({image_id[7:19]})", data={"image_id": image_id})
    return Finding(
        Status.FAIL,
        f"image {image} is not on this host",
        f"`raycluster up` streams it from this machine over SSH (or: docker save {image} | ssh {ctx.address} docker load)",
    )


def _head_nic(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    head = ctx.inventory.head_address
    if rc != 0:
        return Finding(
            Status.FAIL, f"cannot list interfaces ({err.strip() or rc})", "install iproute2 on the head host"
        )
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


def _route_to_head(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    head = ctx.inventory.head_address
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
            f"use {source} as this host's address in the inventory, or fix the routes so {ctx.address} is used",
        )
    return Finding(Status.OK, f"reaches the head {head} from {source}")


def _etc_hosts(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    own_name, _, hosts_text = out.partition("\n---\n")
    name = ctx.host.hostname or own_name.strip()
    address = ctx.inventory.node_ip(ctx.host)
    if rc != 0 or not name:
        return Finding(Status.FAIL, f"cannot read hostname or /etc/hosts ({err.strip()[:120]})", "check the host")
    resolved = resolve_in_hosts(parse_etc_hosts(hosts_text), name)
    fix = f"on {ctx.address}, make /etc/hosts map '{address} {name}' and remove other lines naming {name}"
    if resolved is None:
        return Finding(Status.FAIL, f"/etc/hosts does not name {name} (the Ray container's hostname)", fix)
    if is_loopback(resolved):
        return Finding(Status.FAIL, f"/etc/hosts maps {name} to loopback {resolved}, not {address}", fix)
    if resolved != address:
        return Finding(Status.FAIL, f"/etc/hosts maps {name} to {resolved}, not {address}", fix)
    return Finding(Status.OK, f"{name} → {address} in /etc/hosts")


def _ports_command(ctx: CheckContext) -> str:
    head_filter = quote(f"label=io.raycluster.cluster={ctx.inventory.cluster}")
    return (
        "ss -ltnH; echo ---; docker ps --quiet --filter "
        + head_filter
        + " --filter label=io.raycluster.role=head --filter status=running"
    )


def _ports_free(rc: int, out: str, err: str, ctx: CheckContext) -> Finding:
    listening_text, _, ours = out.partition("\n---\n")
    ray = ctx.inventory.ray
    wanted = {ray.port: "GCS (ray.port)", ray.dashboard_port: "dashboard", ray.client_port: "Ray client"}
    if rc == 127 or "not found" in err:
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


ALL_CHECKS: tuple[Check, ...] = (
    Check("docker", "Docker daemon", lambda ctx: "docker info --format '{{.ServerVersion}}'", _docker),
    Check(
        IMAGE_ID_CHECK,
        "node image",
        lambda ctx: "docker image inspect --format '{{.Id}}' " + quote(ctx.inventory.image),
        _image,
    ),
    Check(
        "head-address",
        "head address on a NIC",
        lambda ctx: "ip -o -4 addr show",
        _head_nic,
        applies=lambda ctx: ctx.host.role == "head",
    ),
    Check(
        "route-to-head",
        "source address towards the head",
        lambda ctx: "ip route get " + quote(ctx.inventory.head_address),
        _route_to_head,
        applies=lambda ctx: ctx.host.role == "worker",
    ),
    Check(
        "ports-free",
        "Ray ports free on the head",
        _ports_command,
        _ports_free,
        applies=lambda ctx: ctx.host.role == "head",
    ),
    Check("etc-hosts", "hostname in /etc/hosts", lambda ctx: "hostname; echo ---; cat /etc/hosts", _etc_hosts),
)
