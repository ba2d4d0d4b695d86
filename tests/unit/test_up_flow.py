"""`up` end to end over faked hosts (recorded outputs): the phase sequence, each host's record, remote commands."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.config.inventory import HostConfig
from raycluster_cli.errors import OperationError
from raycluster_cli.host.node import RAY_STARTED, Plan
from raycluster_cli.progress import HostPhase
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.fake import FakeTransport
from raycluster_cli.verbs import up_phases
from raycluster_cli.verbs.up import NodesMissing, PreflightFailed, up
from raycluster_cli.verbs.up_hosts import RETRIED, RETRIED_KEPT, HostRun
from raycluster_cli.verbs.up_phases import UpRun

from ..counting import CountingConnect
from .conftest import EXAMPLE
from .test_checks import ENGINE, healthy

HOSTS = ("192.0.2.11", "192.0.2.12", "192.0.2.13")
WAIT_HEAD = "end=$(("


class _Host(FakeTransport):
    """A healthy host without our container; its container runs once started (`exits` starts that fail
    first); the head's log says Ray started once its container runs, and the head answers the probe."""

    def __init__(self, address: str, index: int, started: set[str], **overrides: CommandResult | str) -> None:
        super().__init__(address, healthy(address, f"node-{index}", **overrides))
        self.started = started
        self.exits = 0  # how many starts exit at once
        self.starts = 0
        self.stdin: list[bytes] = []
        self.cancelled = threading.Event()

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 120.0) -> CommandResult:
        self.stdin.append(stdin or b"")
        return super().run(command, stdin=stdin, timeout=timeout)

    @property
    def running(self) -> bool:
        return self.host in self.started

    def answer(self, command: str) -> CommandResult:
        if "docker run --label" in command:
            self.commands.append(command)
            self.starts += 1
            if self.starts > self.exits:
                self.started.add(self.host)
            return CommandResult(0, "c0ffee\n", "")
        if "cannot write its files" in command:  # a kept container's files written, nothing started
            self.commands.append(command)
            return CommandResult(0, "", "")
        if command.startswith("docker ps --all"):
            self.commands.append(command)
            return CommandResult(0, "", "")
        if command.startswith(WAIT_HEAD):
            self.commands.append(command)
            assert RAY_STARTED in command
            return CommandResult(0, "", "") if self.running else CommandResult(3, "ValueError: bad option\n", "")
        if "raycluster_cli.host.probe" in command:  # as the real one: until the expected nodes are alive, or ended
            self.commands.append(command)
            if command.startswith(f"( {WAIT_HEAD}") and not self.running:  # a worker's look: its node first
                return CommandResult(3, "", "")
            expect = set(re.search(r"--expect (\S*)", command)[1].split(",")) - {"''"}  # type: ignore[index]
            end = time.monotonic() + float(re.search(r"--timeout (\d+)", command)[1])  # type: ignore[index]
            while not expect <= set(self.started) and time.monotonic() < end:
                if self.cancelled.wait(0.005):
                    return CommandResult(143, "", "")
            nodes = [{"node_ip": ip, "node_id": ip, "alive": True, "resources": {"CPU": 1.0}} for ip in self.started]
            return CommandResult(0, json.dumps({"ok": True, "nodes": nodes}) + "\n", "")
        if "kill $(cat /tmp/raycluster-look-" in command:
            self.commands.append(command)
            self.cancelled.set()
            return CommandResult(0, "", "")
        return super().answer(command)


def _fleet(**overrides: dict[str, CommandResult | str]) -> tuple[dict[str, _Host], CountingConnect]:
    started: set[str] = set()
    fakes = {a: _Host(a, i, started, **overrides.get(a, {})) for i, a in enumerate(HOSTS, 1)}

    def connect(host: HostConfig) -> _Host:
        return fakes[str(host.address)]

    return fakes, CountingConnect(connect)


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path))


INV = EXAMPLE + "image_source: pull\n"  # nothing to stream from this machine's engine


def _phases(events: list[object], host: str) -> list[str]:
    return [e.phase for e in events if isinstance(e, HostPhase) and e.host == host]


def test_up_is_three_remote_commands_per_worker_and_every_host_ends_joined() -> None:
    """Issue 11 target: up ≤ 8 remote commands per worker (it was 18): gather, start, wait for it; one worker
    also asks the GCS for every node (the look), in place of the head."""
    _, counting = _fleet()
    events: list[object] = []
    result = up(inventory.parse(INV), counting, progress=events.append)
    assert result.ok and all(n.action == "started" for n in result.nodes)
    assert counting.counts[HOSTS[1]] == 4  # gather, start, wait for it, the look
    assert counting.counts[HOSTS[2]] == 3 and counting.counts[HOSTS[0]] == 3
    for host in HOSTS:
        assert _phases(events, host) == ["checking", "checked", "starting", "waiting", "waiting", "joined"]
    waits = [e.detail for e in events if isinstance(e, HostPhase) and e.host == HOSTS[1] and e.phase == "waiting"]
    assert waits == ["for its Ray node to register", "registered; the head's GCS is asked"]
    last = [e for e in events if isinstance(e, HostPhase)][-1]
    assert (last.joined, last.total) == (3, 3)
    assert [n.to_dict()["resources"] for n in result.nodes] == [{"CPU": 1.0}] * 3


def _looks(counting: CountingConnect) -> list[str]:
    return [h for h, c in counting.log if "raycluster_cli.host.probe" in c]


def test_the_look_waits_in_a_workers_container_before_the_head_registered() -> None:
    """The look at the GCS is asked while the head starts, from the first worker's container, chained after
    that worker's own registration: it waits there when the head registers, and the head's container (whose
    CPU the head's own start needs) runs no probe. Before, it started once the head had registered."""
    fakes, counting = _fleet()
    asked = threading.Event()
    worker_answer, head_answer = fakes[HOSTS[1]].answer, fakes[HOSTS[0]].answer
    looked_before: list[bool] = []

    def worker(command: str) -> CommandResult:
        if "raycluster_cli.host.probe" in command:
            asked.set()
        return worker_answer(command)

    def head(command: str) -> CommandResult:
        if command.startswith(WAIT_HEAD):
            looked_before.append(asked.wait(5))
        return head_answer(command)

    fakes[HOSTS[1]].answer = worker  # type: ignore[method-assign]
    fakes[HOSTS[0]].answer = head  # type: ignore[method-assign]
    assert up(inventory.parse(INV), counting).ok
    assert looked_before == [True]
    assert _looks(counting) == [HOSTS[1]]
    look = next(c for h, c in counting.log if "raycluster_cli.host.probe" in c)
    assert look.startswith(f"( {WAIT_HEAD}") and "docker exec raycluster-demo-worker " in look


def test_a_look_from_a_worker_that_fails_asks_the_head() -> None:
    fakes, counting = _fleet()
    answer = fakes[HOSTS[1]].answer

    def broken(command: str) -> CommandResult:
        if "raycluster_cli.host.probe" in command:
            return CommandResult(126, "", "OCI runtime exec failed: exec failed: unable to start container process")
        return answer(command)

    fakes[HOSTS[1]].answer = broken  # type: ignore[method-assign]
    result = up(inventory.parse(INV), counting)
    assert result.ok and all(n.action == "started" for n in result.nodes)
    assert _looks(counting) == [HOSTS[1], HOSTS[0]]


@pytest.mark.parametrize(
    ("scratch", "looked_from"), [((HOSTS[1],), HOSTS[2]), ((HOSTS[1], HOSTS[2]), HOSTS[0])], ids=["one", "both"]
)
def test_the_look_is_asked_from_a_worker_only_where_that_worker_joins_early(
    scratch: tuple[str, ...], looked_from: str
) -> None:
    """A worker whose temp folder differs from the head's registers after the head (containers.early_start):
    the look is asked from the first worker that does not, else from the head once it registered."""
    inv = INV
    for address in scratch:
        inv = inv.replace(
            f"{{address: {address}, role: worker", f"{{address: {address}, env: {{TMPDIR: /s}}, role: worker"
        )
    _, counting = _fleet()
    assert up(inventory.parse(inv), counting).ok
    assert _looks(counting) == [looked_from]


def test_every_worker_starts_while_the_head_starts() -> None:
    """The workers' containers start right after the head's, before its registration is waited for (each
    waits in its container for the head's GCS): their start overlaps the head's."""
    _, counting = _fleet()
    up(inventory.parse(INV), counting)
    order = [(h, c) for h, c in counting.log]
    runs = [i for i, (h, c) in enumerate(order) if "docker run --label" in c]
    head_wait = next(i for i, (h, c) in enumerate(order) if c.startswith(WAIT_HEAD))
    assert len(runs) == 3 and order[runs[0]][0] == HOSTS[0]
    assert max(runs) < head_wait


def test_the_files_travel_on_stdin_never_on_the_command_line() -> None:
    fakes, counting = _fleet()
    up(inventory.parse(INV + "env: {SECRET: s3cr3t}\n"), counting)
    started = [c for h, c in counting.log if "docker run --label" in c]
    assert len(started) == 3
    assert not any("s3cr3t" in c for c in started)
    assert all("/etc/raycluster/demo/auth-token" in c and "/etc/raycluster/demo/" in c for c in started)
    assert any(b"SECRET=s3cr3t" in data for data in fakes[HOSTS[1]].stdin)


def test_a_head_that_exits_twice_is_named_with_its_log_and_its_workers_fail_with_it() -> None:
    fakes, counting = _fleet()
    fakes[HOSTS[0]].exits = 2
    events: list[object] = []
    with pytest.raises(OperationError) as info:
        up(inventory.parse(INV), counting, progress=events.append)
    assert "the head container exited: ValueError: bad option" in info.value.message, info.value.message
    assert fakes[HOSTS[0]].starts == 2  # started once more: Ray's fixed 30 s to register can be missed
    failed = {e.host: e.detail for e in events if isinstance(e, HostPhase) and e.phase == "failed"}
    assert sorted(failed) == sorted(HOSTS)
    assert failed[HOSTS[1]] == failed[HOSTS[2]] == f"the head at {HOSTS[0]} did not start"
    assert fakes[HOSTS[1]].starts == fakes[HOSTS[2]].starts == 1  # started with the head, not again


def test_a_head_started_once_more_is_joined_again_by_every_worker() -> None:
    fakes, counting = _fleet()
    fakes[HOSTS[0]].exits = 1
    result = up(inventory.parse(INV), counting)
    assert result.ok and fakes[HOSTS[1]].starts == fakes[HOSTS[2]].starts == 2
    assert [n.reason for n in result.nodes[1:]] == ["the head was started once more"] * 2


def test_a_head_that_exits_once_is_started_once_more_and_says_so() -> None:
    fakes, counting = _fleet()
    fakes[HOSTS[0]].exits = 1
    result = up(inventory.parse(INV), counting)
    head = result.nodes[0]
    assert result.ok and head.action == "restarted" and RETRIED in head.reason


def test_a_running_head_that_exits_before_its_wait_is_started_once_more_and_rejoined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head `up` found running (kept) whose container exits before its wait (after a long freeze, Ray's
    processes can end a few seconds after the unpause) is started once more, and every worker, kept or not,
    joins the new head; before, `up` failed there and only `down` + `up` completed the cluster."""
    fakes, counting = _fleet()
    planned = up_phases.plan_node

    def keep_head(inventory: object, host: HostConfig, *args: object, **kwargs: object) -> Plan:
        return Plan("keep") if host.role == "head" else planned(inventory, host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(up_phases, "plan_node", keep_head)
    events: list[object] = []
    result = up(inventory.parse(INV), counting, progress=events.append)  # the kept head's container is not running
    head = result.nodes[0]
    assert result.ok and head.action == "restarted" and RETRIED_KEPT in head.reason, head
    assert fakes[HOSTS[0]].starts == 1 and fakes[HOSTS[1]].starts == fakes[HOSTS[2]].starts == 2
    said = [e for e in events if isinstance(e, str)]
    assert (
        f"{HOSTS[0]}: the head container, found running, exited before up waited for it; starting it once more" in said
    )


def test_a_worker_that_exits_once_is_started_once_more() -> None:
    fakes, counting = _fleet()
    fakes[HOSTS[2]].exits = 1
    events: list[object] = []
    result = up(inventory.parse(INV), counting, progress=events.append)
    assert result.ok and fakes[HOSTS[2]].starts == 2
    assert [n.action for n in result.nodes] == ["started", "started", "restarted"]
    assert _phases(events, HOSTS[2])[-4:] == ["starting", "waiting", "waiting", "joined"]
    assert counting.counts[HOSTS[2]] == 5  # gather, start, wait, start once more, wait


def test_a_worker_that_never_runs_is_named_and_failed() -> None:
    fakes, counting = _fleet()
    fakes[HOSTS[2]].exits = 99
    events: list[object] = []
    with pytest.raises(NodesMissing) as info:
        up(inventory.parse(INV), counting, progress=events.append, timeout_s=60)
    assert [d["host"] for d in info.value.details] == [HOSTS[2]]
    assert _phases(events, HOSTS[2])[-1] == "failed" and fakes[HOSTS[2]].starts == 2
    assert _phases(events, HOSTS[1])[-1] == "joined"
    # the look that waited in HOSTS[1]'s container for all three was ended; the joined were read from the head
    assert any("kill $(cat /tmp/raycluster-look-" in c for c in fakes[HOSTS[1]].commands)
    assert _looks(counting) == [HOSTS[1], HOSTS[0]]


def test_a_look_whose_worker_never_ran_is_left_and_the_head_is_asked() -> None:
    fakes, counting = _fleet()
    fakes[HOSTS[1]].exits = 99
    with pytest.raises(NodesMissing) as info:
        up(inventory.parse(INV), counting, timeout_s=60)
    assert [d["host"] for d in info.value.details] == [HOSTS[1]]
    assert not any("kill $(cat /tmp/raycluster-look-" in c for c in fakes[HOSTS[1]].commands)
    assert _looks(counting) == [HOSTS[1], HOSTS[0]]


def test_a_failing_check_stops_up_and_marks_that_host_failed() -> None:
    _, counting = _fleet(**{HOSTS[1]: {ENGINE: CommandResult(1, "", "Cannot connect to the Docker daemon")}})
    events: list[object] = []
    with pytest.raises(PreflightFailed):
        up(inventory.parse(INV), counting, progress=events.append)
    failed = [e for e in events if isinstance(e, HostPhase) and e.phase == "failed"]
    assert [e.host for e in failed] == [HOSTS[1]] and failed[0].detail.startswith("docker: ")
    assert not any("docker run --label" in c for _, c in counting.log)


def test_the_record_moves_only_on_a_change_and_counts_the_joined() -> None:
    events: list[object] = []
    _, counting = _fleet()
    run = UpRun(inventory.parse(INV), counting, events.append, 60, frozenset())
    worker: HostRun = run.workers[0]
    run.move(worker, "starting", "x")
    run.move(worker, "starting", "x")
    run.move(run.head, "joined", "started")
    run.move(worker, "joined", "started")
    assert [(e.phase, e.joined, e.total) for e in events if isinstance(e, HostPhase)] == [
        ("starting", 0, 3),
        ("joined", 1, 3),
        ("joined", 2, 3),
    ]
    assert worker.alive and worker.address == HOSTS[1] and worker.role == "worker"
    worker.restarted()
    assert worker.retried and worker.plan.action == "replace" and worker.reason == RETRIED
