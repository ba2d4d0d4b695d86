"""`down --host`: one worker's node drained through the running service first, then its container removed, every
other host untouched; no service: removed at once; a refused drain removes nothing."""

from __future__ import annotations

import json

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.config.inventory import HostConfig
from raycluster_cli.errors import OperationError
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.fake import FakeTransport
from raycluster_cli.verbs.down import down_host

from .conftest import EXAMPLE

WORKER = "192.0.2.13"
PS = json.dumps(
    {
        "ID": "c3",
        "Names": "raycluster-demo-worker",
        "State": "running",
        "Image": "raycluster/node:0.1.0",
        "Labels": "io.raycluster.cluster=demo,io.raycluster.role=worker",
    }
)


class _Host(FakeTransport):
    """A host that lists our container and removes it; the head answers the operator's script with ``reply``."""

    def __init__(self, address: str, reply: dict[str, object] | None = None) -> None:
        super().__init__(address, {r"^docker ps --all": PS + "\n", r"^docker rm -f": ""})
        self.reply = reply
        self.asked: list[dict[str, object]] = []

    def run(self, command: str, *, stdin: bytes | None = None, **kw: object) -> CommandResult:  # type: ignore[override]
        if "get_app_handle" in command:
            self.commands.append(command)
            self.asked.append(json.loads(stdin or b"{}"))
            return CommandResult(0, json.dumps(self.reply) + "\n", "")
        return super().run(command, stdin=stdin)


def _cluster(reply: dict[str, object]) -> tuple[inventory.Inventory, dict[str, _Host], object]:
    inv = inventory.parse(EXAMPLE)
    hosts = {str(h.address): _Host(str(h.address), reply if h.role == "head" else None) for h in inv.hosts}

    def connect(host: HostConfig) -> _Host:
        return hosts[str(host.address)]

    return inv, hosts, connect


def test_the_worker_is_drained_then_only_its_container_removed() -> None:
    drained = {"node": WORKER, "drained": [2], "replaced_by": [3], "finished": 4, "moved": 0, "seconds": 9.0}
    inv, hosts, connect = _cluster({"answer": drained})
    result = down_host(inv, connect, WORKER, deadline_s=30)  # type: ignore[arg-type]
    assert hosts["192.0.2.11"].asked == [{"method": "drain", "args": [WORKER, 30], "timeout_s": 630.0}]
    assert result.ok and result.removed == [{"host": WORKER, "container": "raycluster-demo-worker"}]
    assert result.drained is not None and result.drained["finished"] == 4 and result.drained["replaced_by"] == [3]
    assert [c for c in hosts["192.0.2.12"].commands if "docker rm" in c] == []  # the rest untouched
    assert [c for c in hosts["192.0.2.11"].commands if "docker rm" in c] == []


def test_without_a_service_the_container_is_removed_at_once() -> None:
    inv, _, connect = _cluster({"absent": True})
    result = down_host(inv, connect, WORKER, deadline_s=30)  # type: ignore[arg-type]
    assert result.drained is None and [r["host"] for r in result.removed] == [WORKER]


def test_a_refused_drain_removes_nothing_and_names_the_fix() -> None:
    inv, hosts, connect = _cluster({"answer": {"node": WORKER, "refused": "no other node can hold the model"}})
    with pytest.raises(OperationError) as refused:
        down_host(inv, connect, WORKER, deadline_s=30)  # type: ignore[arg-type]
    assert "no other node can hold the model" in refused.value.message and "raycluster up" in refused.value.hint
    assert [c for c in hosts[WORKER].commands if "docker rm" in c] == []
