"""The operator's side of bench: options sent as JSON, progress followed, failures named by host."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from raycluster_cli import cancel
from raycluster_cli.bench.options import BenchOptions
from raycluster_cli.config import inventory
from raycluster_cli.transport.base import CommandResult
from raycluster_cli.verbs import bench as client
from raycluster_cli.verbs.bench import BenchEvent, BenchFailed, run_bench

RUNNING = json.dumps({"ID": "c1", "Names": "ray-demo-head", "State": "running", "Image": "x", "Labels": ""})


class ScriptedHead:
    """The head host: answers docker ps, takes the options file; each poll the driver has written one
    more piece of its progress file (the last piece also its exit status)."""

    def __init__(self, polls: list[str], result: dict[str, Any]) -> None:
        self.host = "192.0.2.11"
        self.polls = list(polls)
        self.progress = ""
        self.result = result
        self.commands: list[str] = []
        self.stdin: list[bytes] = []

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 120.0) -> CommandResult:
        self.commands.append(command)
        if stdin is not None:
            self.stdin.append(stdin)
        if command.startswith("docker ps"):
            return CommandResult(0, RUNNING + "\n", "")
        if "tail -c" in command:
            offset = int(re.search(r"tail -c \+(\d+)", command).group(1))  # type: ignore[union-attr]
            self.progress += self.polls.pop(0) if self.polls else ""
            rc = "" if self.polls else "0\n"
            return CommandResult(0, self.progress[offset - 1 :] + "@@raycluster-rc\n" + rc, "")
        if "result.json" in command and "cat" in command and "python" not in command:
            return CommandResult(0, json.dumps(self.result) + "\n", "")
        return CommandResult(0, "", "")

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        raise AssertionError("not used")

    def close(self) -> None:
        pass


def _inventory(example_yaml: str) -> inventory.Inventory:
    return inventory.parse(example_yaml)


def _line(**event: Any) -> str:
    return json.dumps({"t": 0.0, "done": None, "total": None, **event}) + "\n"


@pytest.fixture(autouse=True)
def _fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "POLL_S", 0.0)


def test_options_go_as_json_and_progress_comes_back_with_hosts(example_yaml: str) -> None:
    polls = [
        _line(phase="calibrating 3 node(s)") + '{"phase": "pil',  # half a line: read again next time
        'ot 1/3", "done": 4, "total": 32, "step": "requests"}\n',
        _line(phase="counted run", step="node lost", node_ip="192.0.2.13", stage=2),
    ]
    result = {"ok": True, "stages": [{"node_ip": "192.0.2.13"}], "references": {"unsharded": {"node_ip": "192.0.2.11"}}}
    head = ScriptedHead(polls, result)
    events: list[BenchEvent] = []
    options = BenchOptions(layers=24, rate=2.0)
    doc = run_bench(_inventory(example_yaml), lambda h: head, options, progress=events.append)
    assert BenchOptions.model_validate_json(head.stdin[0]) == options  # the model itself, not an argv
    assert [e.phase for e in events] == ["calibrating 3 node(s)", "pilot 1/3", "counted run"]
    assert events[1].done == 4 and events[1].total == 32
    assert events[2].extra["host"] == "192.0.2.13"
    assert doc["stages"][0]["host"] == "192.0.2.13" and doc["references"]["unsharded"]["host"] == "192.0.2.11"
    started = next(c for c in head.commands if c.startswith("docker exec -d"))
    assert "raycluster_cli.bench.driver --options @" in started
    assert any("rm -rf /tmp/raycluster-bench/" in c for c in head.commands)  # cleaned up after success


def test_quick_is_resolved_before_it_is_sent(example_yaml: str) -> None:
    head = ScriptedHead([], {"ok": True})
    run_bench(_inventory(example_yaml), lambda h: head, BenchOptions(quick=True, refine=2))
    sent = BenchOptions.model_validate_json(head.stdin[0])
    assert sent.refine == 2 and sent.requests == 12 and sent.calibration_repeats == 2


def test_a_lost_stage_is_named_by_host_with_the_counts(example_yaml: str) -> None:
    failure = {"replica": 0, "stage": 2, "node_ip": "192.0.2.13", "error": "ActorDiedError: gone"}
    failure |= {"completed": 412, "failed": 588, "requests": 1000}
    head = ScriptedHead([], {"ok": False, "error": "stage 2 on 192.0.2.13 was lost", "failure": failure})
    with pytest.raises(BenchFailed) as caught:
        run_bench(_inventory(example_yaml), lambda h: head, BenchOptions())
    message = caught.value.message
    assert message.startswith("192.0.2.13: stage 2") and "412 of 1000" in message and "588 not completed" in message
    assert caught.value.failure["host"] == "192.0.2.13" and "192.0.2.13" in caught.value.hint


def test_other_failures_point_at_the_driver_log(example_yaml: str) -> None:
    head = ScriptedHead([], {"ok": False, "error": "ValueError: 4 stages but the model has 3 blocks"})
    with pytest.raises(BenchFailed, match="4 stages") as caught:
        run_bench(_inventory(example_yaml), lambda h: head, BenchOptions())
    assert "driver.log" in caught.value.hint and not caught.value.failure


def test_interrupt_stops_the_driver(example_yaml: str, monkeypatch: pytest.MonkeyPatch) -> None:
    head = ScriptedHead([], {"ok": True})

    def interrupt(_: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(client.time, "sleep", interrupt)
    head.polls = [_line(phase="calibrating"), ""]
    with pytest.raises(KeyboardInterrupt):
        run_bench(_inventory(example_yaml), lambda h: head, BenchOptions())
    assert any("kill -INT" in c and c.startswith("docker exec -d") for c in head.commands)


def test_the_driver_is_stopped_after_ctrl_c_cancelled_host_work(example_yaml: str) -> None:
    """Ctrl-C sets the cancellation flag (no more remote commands); stopping the driver still goes out."""
    head = ScriptedHead([_line(phase="calibrating"), ""], {"ok": True})
    real = head.run

    def interrupted(command: str, **kwargs: Any) -> CommandResult:
        if "tail -c" in command:
            cancel.request()
            raise cancel.Cancelled("interrupted")
        if cancel.requested():
            raise cancel.Cancelled("interrupted")
        return real(command, **kwargs)

    head.run = interrupted  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            run_bench(_inventory(example_yaml), lambda h: head, BenchOptions())
        assert cancel.requested()  # the flag is back for everything else
    finally:
        cancel.reset()
    assert any("kill -INT" in c for c in head.commands)


def test_a_head_that_is_not_running_is_refused(example_yaml: str) -> None:
    head = ScriptedHead([], {})
    head.run = lambda command, **_: CommandResult(0, "", "")  # type: ignore[method-assign]
    with pytest.raises(client.OperationError, match="head is not running"):
        run_bench(_inventory(example_yaml), lambda h: head, BenchOptions())


def test_a_failed_poll_is_retried_while_the_driver_runs(example_yaml: str) -> None:
    head = ScriptedHead([_line(phase="calibrating"), ""], {"ok": True})
    real = head.run
    failures = [1]

    def flaky(command: str, **kwargs: Any) -> CommandResult:
        if "tail -c" in command and failures:
            failures.pop()
            raise client.RayclusterError("10.0.0.1: a command ran past 60s", "")
        return real(command, **kwargs)

    head.run = flaky  # type: ignore[method-assign]
    assert run_bench(_inventory(example_yaml), lambda h: head, BenchOptions())["ok"] is True
