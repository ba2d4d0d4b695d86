"""The head's node list when the head's container is paused (`docker pause`, a frozen cgroup): `up` says so,
names the head and the fix, whether the pause came before the probe's `docker exec` (refused at once) or while
it ran (the exec waits until its deadline, then the container's state is read)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.errors import OperationError
from raycluster_cli.host import node as nodes
from raycluster_cli.host.node import cancel_probe, probe
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.fake import FakeTransport
from raycluster_cli.transport.sshio import DeadlineExceeded

from .conftest import EXAMPLE

HEAD = "192.0.2.11"
NAME = "raycluster-demo-head"
REFUSED = "Error response from daemon: Container 3f2a is paused, unpause the container before exec\n"


class ProbeNeverAnswers(FakeTransport):
    """The probe's `docker exec` runs past its deadline; the other commands answer from the table."""

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 120.0) -> CommandResult:
        if "raycluster_cli.host.probe" in command:
            self.commands.append(command)
            raise DeadlineExceeded(self.host, "`docker exec …` ran past its 65s deadline", "the host is stuck")
        return super().run(command, stdin=stdin, timeout=timeout)


def _assert_names_the_pause(error: OperationError) -> None:
    assert error.message.startswith(f"{HEAD}: the head's container {NAME} is paused"), error.message
    assert (
        f"docker unpause {NAME}` on {HEAD}" in error.hint and "then `raycluster down` and `raycluster up`" in error.hint
    )


def test_an_exec_refused_by_a_paused_head_says_so_with_the_fix() -> None:
    head = FakeTransport(HEAD, {"raycluster_cli.host.probe": CommandResult(1, "", REFUSED)})
    with pytest.raises(OperationError) as caught:
        probe(head, inventory.parse(EXAMPLE), [HEAD], 5, cancellable="k1")
    _assert_names_the_pause(caught.value)


def test_a_probe_frozen_with_its_container_reads_the_state_once_and_says_paused() -> None:
    head = ProbeNeverAnswers(HEAD, {r"State\.Paused": "true\n"})
    with pytest.raises(OperationError) as caught:
        probe(head, inventory.parse(EXAMPLE), [HEAD], 5)
    _assert_names_the_pause(caught.value)
    assert len(head.commands) == 2 and NAME in head.commands[1]


@pytest.mark.parametrize("state", [CommandResult(0, "false\n", ""), CommandResult(1, "", "No such container")])
def test_a_probe_past_its_deadline_on_a_running_or_unknown_container_stays_a_deadline(state: CommandResult) -> None:
    head = ProbeNeverAnswers(HEAD, {r"State\.Paused": state})
    with pytest.raises(DeadlineExceeded):
        probe(head, inventory.parse(EXAMPLE), [HEAD], 5)


# ending a look's probe (cancel_probe), in a real shell: the container's side of both commands ----------------


def _in_container(command: str) -> str:
    """The part of a `docker exec NAME …` command that runs in the container."""
    prefix = f"docker exec {NAME} "
    assert command.startswith(prefix), command
    return command[len(prefix) :]


def _look(key: str) -> str:
    """The container's side of a cancellable probe, its Python replaced by a long sleep."""
    head = FakeTransport(HEAD, {"raycluster_cli.host.probe": CommandResult(1, "", "")})
    with pytest.raises(OperationError):
        probe(head, inventory.parse(EXAMPLE), [HEAD], 5, cancellable=key)
    side = _in_container(head.commands[0])
    return side[: side.index("python -m raycluster_cli.host.probe")] + "sleep 30"


def _end(key: str) -> str:
    head = FakeTransport(HEAD, {"": ""})
    cancel_probe(head, inventory.parse(EXAMPLE), key)
    return _in_container(head.commands[0])


def test_a_running_look_is_ended_and_one_ended_before_it_started_never_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nodes, "_LOOK_FILES", f"{tmp_path}/look-")
    running = subprocess.Popen(["sh", "-c", _look("a1")])
    pid_file = tmp_path / "look-a1.pid"
    deadline = time.monotonic() + 10
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    started = time.monotonic()
    assert subprocess.run(["sh", "-c", _end("a1")]).returncode == 0
    assert running.wait(10) != 0 and time.monotonic() - started < 5  # the sleep was killed, not waited for

    assert subprocess.run(["sh", "-c", _end("b2")]).returncode == 0  # ended before it started
    begun = time.monotonic()
    assert subprocess.run(["sh", "-c", _look("b2")], timeout=10).returncode == 143
    assert time.monotonic() - begun < 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["look-b2.end", "look-b2.pid"]  # a1's files removed
