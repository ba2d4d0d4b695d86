"""`drain HOST`, `undrain HOST` and the service told of a node `up` added: the operator's calls to the running
service.

They reach the service the way `serve --stop` does: a short Python in the head's container (over the operator's
SSH, the cluster's Ray token in that container) joins the cluster and calls the ingress deployment's own methods
through Ray Serve's handle (``OpenAIServer.drain``/``undrain``/``take_in``, serve/app.py). No HTTP route and no
service key can reach them, and nothing new listens anywhere. Never prints.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.errors import OperationError, UsageError
from raycluster_cli.host.containers import SOURCE_ENV, container_name
from raycluster_cli.transport import quote
from raycluster_cli.transport.pool import Connect
from raycluster_cli.verbs.serve import APP, _last_json

# Building the pipelines that replace a drained node's (their stages load the model, a probe generates through
# them; serve/fleet.py's BUILD_TIMEOUT_S and the calibration of nodes it has not measured) takes at most this long.
REPLACE_S = 600.0
JOIN_S = 60.0  # the head's Python joining the cluster and finding the application
DEADLINE_DEFAULT_S = 120.0

_CALL = """
import json, sys
import ray
from ray import serve
asked = json.loads(sys.stdin.read())
ray.init(address="auto", logging_level="ERROR")
if %(app)r not in serve.status().applications:
    print(json.dumps({"absent": True}))
    sys.exit(0)
handle = serve.get_app_handle(%(app)r)
try:
    answer = getattr(handle, asked["method"]).remote(*asked["args"]).result(timeout_s=asked["timeout_s"])
    print(json.dumps({"answer": answer}))
except Exception as exc:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    print(json.dumps({"error": f"{type(exc).__name__}: {lines[-1] if lines else ''}"}))
"""


class NoService(OperationError):
    """No service is deployed on the cluster."""


@dataclass
class DrainResult:
    """What `drain` did: the host and its node's IP, the pipelines taken off it and those that replaced them, the
    streams that finished there and those moved at the deadline, and how long it took."""

    host: str
    node_ip: str
    action: str  # drained / undrained / taken in
    drained: list[int] = field(default_factory=list)
    replaced_by: list[int] = field(default_factory=list)
    grown: list[int] = field(default_factory=list)
    finished: int = 0
    moved: int = 0
    seconds: float = 0.0
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_host(inventory: Inventory, address: str) -> HostConfig:
    """The inventory's host ``address``, or a usage error that names it and the hosts there are."""
    known = {str(h.address): h for h in inventory.hosts}
    if address not in known:
        raise UsageError(f"host {address} is not in the inventory", "use one of: " + ", ".join(known))
    return known[address]


def check_deadline(deadline_s: float) -> None:
    if deadline_s < 0:
        raise UsageError(f"--deadline {deadline_s:g} is negative", "give the seconds streams get to finish, e.g. 120")


def call_service(inventory: Inventory, connect: Connect, method: str, args: list[Any], timeout_s: float) -> Any:
    """The ingress's ``method(*args)`` through Ray Serve's handle from the head's container; ``NoService`` when
    none is deployed."""
    transport = connect(inventory.head_host)
    head = quote(container_name(inventory, inventory.head_host))
    script = _CALL % {"app": APP}
    command = f"docker exec -i {head} sh -c {quote(f'{SOURCE_ENV} && python -c {shlex.quote(script)}')}"
    asked = {"method": method, "args": args, "timeout_s": timeout_s}
    result = transport.run(command, stdin=json.dumps(asked).encode(), timeout=timeout_s + JOIN_S)
    document = _last_json(result.stdout)
    if not result.ok or document is None:
        raise OperationError(
            f"{inventory.head_address}: could not reach the service: {result.first_line() or result.rc}",
            "check the head: raycluster status",
        )
    if document.get("absent"):
        raise NoService(f"no service is deployed on cluster {inventory.cluster}", "raycluster serve --model-path DIR")
    if "error" in document:
        raise OperationError(
            f"{inventory.head_address}: the service's {method} failed: {document['error']}", "raycluster status"
        )
    return document.get("answer")


def drain(inventory: Inventory, connect: Connect, address: str, deadline_s: float = DEADLINE_DEFAULT_S) -> DrainResult:
    """Take the host's node out of the service's pipelines; returns once its streams finished or moved."""
    check_deadline(deadline_s)
    host = find_host(inventory, address)
    ip = inventory.node_ip(host)
    answer = call_service(inventory, connect, "drain", [ip, deadline_s], deadline_s + REPLACE_S)
    if not isinstance(answer, dict):
        raise OperationError(f"{inventory.head_address}: the service answered {answer!r}", "raycluster status")
    if "refused" in answer:
        raise OperationError(
            f"drain {address}: {answer['refused']}", "add a node first (raycluster up), or raycluster serve --stop"
        )
    keep = ("drained", "replaced_by", "finished", "moved", "seconds", "note")
    return DrainResult(address, ip, "drained", **{k: answer[k] for k in keep if k in answer})


def undrain(inventory: Inventory, connect: Connect, address: str) -> DrainResult:
    """Let the host's node back into the service's pipelines, taken in at once."""
    ip = inventory.node_ip(find_host(inventory, address))
    answer = call_service(inventory, connect, "take_in", [[ip]], REPLACE_S) or {}
    note = "" if answer.get("undrained") else "it was not drained"
    return DrainResult(address, ip, "undrained", grown=list(answer.get("grown") or []), note=note)


def take_in(inventory: Inventory, connect: Connect, hosts: list[HostConfig]) -> list[int] | None:
    """Tell the service that ``up`` started ``hosts``' nodes (added, or back after `down --host`): they are let back
    and every node no pipeline uses is taken in now.  The pipelines it added; None when no service is deployed."""
    ips = [inventory.node_ip(h) for h in hosts]
    try:
        answer = call_service(inventory, connect, "take_in", [ips], REPLACE_S)
    except NoService:
        return None
    return list((answer or {}).get("grown") or [])
