"""Why did a host's Ray node not join? Evidence gathered on the host, and a pure diagnosis of it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.host.containers import container_name
from raycluster_cli.host.facts import Fact
from raycluster_cli.transport import PART_SEPARATOR, quote

_GCS_TROUBLE = re.compile(r"(connect|reach).{0,40}\bGCS\b|\bGCS\b.{0,60}(unavailable|timed? ?out|refused)", re.I)
_AUTH_TROUBLE = re.compile(r"unauthenticated|authentication (failed|token)|invalid (auth )?token", re.I)
_ERROR_LINE = re.compile(r"error|exception|traceback|failed|killed|denied|refused", re.I)


@dataclass(frozen=True)
class Evidence:
    """What a host says about its node container (one SSH round trip, see `evidence_command`)."""

    hostname: str = ""
    state: str = ""  # "" when there is no container; else running / exited / created / ...
    exit_code: int | None = None
    image_present: bool = True
    gcs_reachable: bool | None = None  # from inside the running container; None: not tested
    log_tail: list[str] = field(default_factory=list)


def evidence_command(inventory: Inventory, host: HostConfig, lines: int = 15) -> str:
    name = quote(container_name(inventory, host))
    gcs = (inventory.head_address, inventory.ray.port)
    connect = f"import socket; socket.create_connection(({gcs[0]!r}, {gcs[1]}), 3)"
    sep = f"echo {PART_SEPARATOR}"
    return "; ".join(
        [
            "hostname",
            sep,
            f"docker inspect --format '{{{{.State.Status}}}} {{{{.State.ExitCode}}}}' {name} 2>/dev/null",
            sep,
            f"docker image inspect {quote(inventory.image)} >/dev/null 2>&1 && echo yes || echo no",
            sep,
            f"if [ \"$(docker inspect --format '{{{{.State.Running}}}}' {name} 2>/dev/null)\" = true ]; then "
            f"timeout 10 docker exec {name} python -c {quote(connect)} >/dev/null 2>&1 && echo yes || echo no; fi",
            sep,
            f"docker logs --tail {lines} {name} 2>&1",
        ]
    )


def parse_evidence(text: str) -> Evidence:
    parts = [p.strip("\n") for p in text.split(PART_SEPARATOR)]
    parts += [""] * (5 - len(parts))
    hostname, state_text, image, gcs, logs = parts[:5]
    state, _, code = state_text.strip().partition(" ")
    return Evidence(
        hostname=hostname.strip(),
        state=state,
        exit_code=int(code) if code.strip().lstrip("-").isdigit() else None,
        image_present=image.strip() != "no",
        gcs_reachable={"yes": True, "no": False}.get(gcs.strip()),
        log_tail=[line.rstrip() for line in logs.splitlines() if line.strip()],
    )


def diagnose(
    inventory: Inventory,
    host: HostConfig,
    evidence: Evidence,
    nodes: list[dict[str, Any]],
    missing_count: int = 1,
) -> str:
    """The likely reason why `host`'s node is not an alive Ray node, in one sentence (pure).

    `nodes` are the nodes the head's GCS knows (node_ip, hostname, alive).
    """
    expected = {inventory.node_ip(h) for h in inventory.hosts}
    name = f"{host.role} {host.address}" + (f" ({evidence.hostname})" if evidence.hostname else "")
    ip = inventory.node_ip(host)
    gcs = f"{inventory.head_address}:{inventory.ray.port}"
    if not evidence.state:
        if not evidence.image_present:
            return f"{name}: no container, and image {inventory.image} is missing on the host"
        return f"{name}: its container is gone (removed while up was waiting?)"
    gcs_trouble = evidence.gcs_reachable is False or any(_GCS_TROUBLE.search(line) for line in evidence.log_tail)
    unreachable = f"could not reach the head's GCS at {gcs} (firewall, route or head address?)"
    if evidence.state != "running":
        code = f", exit code {evidence.exit_code}" if evidence.exit_code is not None else ""
        last = _last_error(evidence.log_tail)
        why = "killed for lack of memory? " if evidence.exit_code == 137 else ""
        if gcs_trouble:
            why = f"{unreachable}; "
        return f"{name}: its container {evidence.state}{code}: {why}{last or 'no log'}"
    strangers = [n for n in nodes if n.get("alive") and n.get("node_ip") not in expected]
    same_host = [n for n in strangers if evidence.hostname and n.get("hostname") == evidence.hostname]
    if same_host or (len(strangers) == 1 and missing_count == 1):
        seen = (same_host or strangers)[0]["node_ip"]
        return f"{name} registered from {seen}, inventory says {ip}"
    if gcs_trouble:
        return f"{name}: {unreachable}"
    if any(_AUTH_TROUBLE.search(line) for line in evidence.log_tail):
        return f"{name}: the head refused its auth token (another cluster's token file on this host?)"
    last = _last_error(evidence.log_tail)
    detail = f"; last error: {last}" if last else ""
    return f"{name}: container running but its Ray node has not registered (still starting?){detail}"


def _last_error(lines: list[str]) -> str:
    for line in reversed(lines):
        if _ERROR_LINE.search(line):
            return line.strip()[:200]
    return lines[-1].strip()[:200] if lines else ""


EVIDENCE: Fact[Evidence] = Fact(
    "evidence", lambda ctx: evidence_command(ctx.inventory, ctx.host), lambda result: parse_evidence(result.stdout)
)
