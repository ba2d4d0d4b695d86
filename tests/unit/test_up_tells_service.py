"""`up` tells a running service of the workers it started (added to the inventory, or back after `down --host`):
through the head's container and Ray Serve's handle (verbs/drain.py), only when the head was kept and a worker
started, and a service that cannot be told is a warning, never a failed `up`."""

from __future__ import annotations

import json

from raycluster_cli.config import inventory
from raycluster_cli.config.inventory import HostConfig
from raycluster_cli.progress import quiet
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.fake import FakeTransport
from raycluster_cli.verbs.up import tell_service
from raycluster_cli.verbs.up_phases import UpRun

from .conftest import EXAMPLE


class _Head(FakeTransport):
    """The head's answer to the operator's script: ``reply`` as its last line; what it was asked, kept."""

    def __init__(self, reply: dict[str, object] | None, rc: int = 0) -> None:
        super().__init__("192.0.2.11", {})
        self.reply, self.rc = reply, rc
        self.asked: list[dict[str, object]] = []

    def run(self, command: str, *, stdin: bytes | None = None, **_: object) -> CommandResult:  # type: ignore[override]
        assert "docker exec -i" in command and "get_app_handle" in command
        self.asked.append(json.loads(stdin or b"{}"))
        return CommandResult(self.rc, json.dumps(self.reply) + "\n" if self.reply else "", "boom" if self.rc else "")


def _run(head: _Head, actions: dict[str, str]) -> UpRun:
    inv = inventory.parse(EXAMPLE)

    def connect(host: HostConfig) -> _Head:
        assert host.role == "head"
        return head

    run = UpRun(inv, connect, quiet, 1.0, frozenset())  # type: ignore[arg-type]
    for address, action in actions.items():
        run.runs[address].action, run.runs[address].phase = action, "joined"
    return run


def test_a_worker_started_beside_a_kept_head_is_let_back_and_taken_in() -> None:
    head = _Head({"answer": {"undrained": ["192.0.2.13"], "grown": [4]}})
    run = _run(head, {"192.0.2.11": "running", "192.0.2.12": "running", "192.0.2.13": "started"})
    warnings: list[str] = []
    assert tell_service(run, run.connect, quiet, warnings) == [4]
    assert head.asked == [{"method": "take_in", "args": [["192.0.2.13"]], "timeout_s": 600.0}] and warnings == []


def test_nothing_is_asked_when_every_worker_was_kept_or_the_head_is_new() -> None:
    head = _Head({"answer": {"grown": []}})
    kept = _run(head, dict.fromkeys(("192.0.2.11", "192.0.2.12", "192.0.2.13"), "running"))
    assert tell_service(kept, kept.connect, quiet, []) is None
    new_head = _run(head, {"192.0.2.11": "started", "192.0.2.12": "started", "192.0.2.13": "started"})
    assert tell_service(new_head, new_head.connect, quiet, []) is None
    assert head.asked == []


def test_no_service_is_none_and_an_unreachable_one_a_warning() -> None:
    actions = {"192.0.2.11": "running", "192.0.2.12": "running", "192.0.2.13": "restarted"}
    absent = _run(_Head({"absent": True}), actions)
    assert tell_service(absent, absent.connect, quiet, []) is None
    failing = _run(_Head(None, rc=1), actions)
    warnings: list[str] = []
    assert tell_service(failing, failing.connect, quiet, warnings) is None
    assert len(warnings) == 1 and "could not reach the service" in warnings[0] and "by itself" in warnings[0]
