"""`raycluster status`: per host the container, the Ray node, its resources, image and Ray version, and the models
in its cache (delivery/models.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.delivery.models import held_command, parse_models
from raycluster_cli.errors import RayclusterError
from raycluster_cli.host.containers import LABEL_CLUSTER, LABEL_ROLE, container_name
from raycluster_cli.host.engine import image_id
from raycluster_cli.host.node import probe
from raycluster_cli.transport import PART_SEPARATOR, prefetch, quote
from raycluster_cli.transport.fanout import error_message, fanout
from raycluster_cli.transport.pool import Connect
from raycluster_cli.verbs.serve import service_status

_VERSION = "from importlib.metadata import version; print(version('ray'))"


@dataclass
class HostStatus:
    host: str
    role: str
    node_ip: str
    container: str  # running / exited / ... / missing / foreign / unreachable
    ray_node: str = "absent"  # alive / dead / absent (as the head's GCS sees it) / unknown
    resources: dict[str, float] = field(default_factory=dict)
    image_id: str = ""
    ray_version: str = ""
    models: list[dict[str, Any]] = field(default_factory=list)  # what its model cache holds: digest, size, name
    error: str = ""
    drained: bool = False  # the running service keeps its node out (`raycluster drain`; `undrain` lets it back)

    @property
    def healthy(self) -> bool:
        return self.container == "running" and self.ray_node == "alive"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"healthy": self.healthy}


@dataclass
class StatusResult:
    hosts: list[HostStatus]
    service: dict[str, Any] | None = None  # what `serve` deployed, as the head sees it (verbs/serve.py)
    service_error: str = ""

    @property
    def state(self) -> str:
        """healthy (every host's node alive), degraded (some), or down (none)."""
        healthy = sum(h.healthy for h in self.hosts)
        return "healthy" if healthy == len(self.hosts) else ("down" if healthy == 0 else "degraded")

    def totals(self) -> dict[str, Any]:
        resources: dict[str, float] = {}
        for host in self.hosts:
            if host.healthy:
                for name, amount in host.resources.items():
                    resources[name] = resources.get(name, 0.0) + amount
        return {
            "hosts": len(self.hosts),
            "alive_nodes": sum(h.healthy for h in self.hosts),
            "resources": dict(sorted(resources.items())),
        }


def host_command(inventory: Inventory, host: HostConfig) -> str:
    name = quote(container_name(inventory, host))
    labels = f'{{{{index .Config.Labels "{LABEL_CLUSTER}"}}}}/{{{{index .Config.Labels "{LABEL_ROLE}"}}}}'
    return (
        f"docker inspect --format '{{{{.State.Status}}}} {{{{.Image}}}} {labels}' {name} 2>/dev/null; echo {PART_SEPARATOR}; "
        f"docker exec {name} python -c {quote(_VERSION)} 2>/dev/null; echo {PART_SEPARATOR}; "
        f"{held_command(inventory, host)}"
    )


def parse_host(inventory: Inventory, host: HostConfig, text: str) -> HostStatus:
    """HostStatus from the output of `host_command` (pure)."""
    state_text, _, rest = text.partition(PART_SEPARATOR)
    version, _, held = rest.partition(PART_SEPARATOR)
    fields = state_text.split()
    status = HostStatus(str(host.address), host.role, inventory.node_ip(host), "missing")
    status.models = [m.to_dict() for m in parse_models(held)]
    if len(fields) >= 3:
        ours = fields[2] == f"{inventory.cluster}/{host.role}"
        status.container = fields[0] if ours else "foreign"
        status.image_id = image_id(fields[1]) or fields[1]
        status.ray_version = version.strip() if ours else ""
    return status


def merge_nodes(hosts: list[HostStatus], nodes: list[dict[str, Any]] | None) -> None:
    """Fill in each host's Ray node from the GCS's node list (None: the head could not be asked) (pure)."""
    for host in hosts:
        if nodes is None:
            host.ray_node = "unknown"
            continue
        mine = [n for n in nodes if isinstance(n, dict) and n.get("node_ip") == host.node_ip]
        alive = [n for n in mine if n.get("alive")]
        host.ray_node = "alive" if alive else ("dead" if mine else "absent")
        if alive:
            given = alive[-1].get("resources")
            amounts = given.items() if isinstance(given, dict) else []
            host.resources = {str(k): float(v) for k, v in amounts if isinstance(v, int | float)}


@prefetch.builder("status")
def _look(inventory: Inventory, host: HostConfig, args: dict[str, Any]) -> tuple[str, float]:
    """Status's look at one host, and its timeout (made again by the next run: prefetch.py)."""
    return host_command(inventory, host), 60


def status(inventory: Inventory, connect: Connect) -> StatusResult:
    def one(host: HostConfig) -> HostStatus:
        transport = connect(host)
        with prefetch.read_only("status"):  # a look only: the next run of this command line may start it ahead
            command, timeout = _look(inventory, host, {})
            out = transport.run(command, timeout=timeout)
        return parse_host(inventory, host, out.stdout)

    hosts: list[HostStatus] = []
    found = fanout(inventory.hosts, one, what="inspect the containers")
    found.check_interrupted()
    for host, outcome in found:
        if outcome.value is not None:
            hosts.append(outcome.value)
        else:
            message = error_message(outcome.error or RuntimeError("no result"))
            hosts.append(
                HostStatus(str(host.address), host.role, inventory.node_ip(host), "unreachable", error=message)
            )
    head = hosts[inventory.hosts.index(inventory.head_host)]
    nodes: list[dict[str, Any]] | None = None
    result = StatusResult(hosts)
    if head.container == "running":
        service = fanout([0], lambda _: service_status(inventory, connect), what="ask the head for the service")
        try:
            nodes = probe(connect(inventory.head_host), inventory, [], 0)
        except RayclusterError as exc:
            head.error = exc.message
        ((_, asked),) = service.pairs
        result.service = asked.value
        result.service_error = error_message(asked.error) if asked.error else ""
    merge_nodes(hosts, nodes)
    mark_drained(hosts, result.service)
    return result


def mark_drained(hosts: list[HostStatus], service: dict[str, Any] | None) -> None:
    """Mark the hosts whose node the service's own view lists as drained (pure)."""
    listed = ((service or {}).get("live") or {}).get("drained") or []
    drained = {str(d.get("node")) for d in listed if isinstance(d, dict)}
    for host in hosts:
        host.drained = host.node_ip in drained
