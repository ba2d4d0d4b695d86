"""The head's node list when the head's container is paused (`docker pause`, a frozen cgroup): `up` says so,
names the head and the fix, whether the pause came before the probe's `docker exec` (refused at once) or while
it ran (the exec waits until its deadline, then the container's state is read)."""

from __future__ import annotations

import pytest

from raycluster_cli import inventory
from raycluster_cli.errors import OperationError
from raycluster_cli.nodes import probe
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
        if "raycluster_cli.probe" in command:
            self.commands.append(command)
            raise DeadlineExceeded(self.host, "`docker exec …` ran past its 65s deadline", "the host is stuck")
        return super().run(command, stdin=stdin, timeout=timeout)


def _assert_names_the_pause(error: OperationError) -> None:
    assert error.message.startswith(f"{HEAD}: the head's container {NAME} is paused"), error.message
    assert (
        f"docker unpause {NAME}` on {HEAD}" in error.hint and "then `raycluster down` and `raycluster up`" in error.hint
    )


def test_an_exec_refused_by_a_paused_head_says_so_with_the_fix() -> None:
    head = FakeTransport(HEAD, {"raycluster_cli.probe": CommandResult(1, "", REFUSED)})
    with pytest.raises(OperationError) as caught:
        probe(head, inventory.parse(EXAMPLE), [HEAD], 5, cancellable=True)
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
