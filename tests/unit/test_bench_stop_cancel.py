"""bench's stop() sends its one command after Ctrl-C without lifting the process-wide cancellation flag (issue
34, item 15): lifting it let queued host work in other threads start in that window."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from raycluster_cli import cancel
from raycluster_cli.transport import CommandResult
from raycluster_cli.verbs.bench import _Run


class Watching:
    """A transport whose run() looks at the flag from its own thread (it must pass) and from another."""

    host = "192.0.2.11"

    def __init__(self) -> None:
        self.commands: list[str] = []
        self.seen_elsewhere: list[bool] = []

    def run(self, command: str, **_: object) -> CommandResult:
        cancel.check("the stop command")  # this one command runs
        other = threading.Thread(target=lambda: self.seen_elsewhere.append(cancel.requested()))
        other.start()
        other.join()
        self.commands.append(command)
        return CommandResult(0, "", "")


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    yield
    cancel.reset()


def test_stop_after_ctrl_c_keeps_the_flag_for_every_other_thread() -> None:
    transport = Watching()
    cancel.request()
    _Run(transport, "raycluster-demo-head").stop()  # type: ignore[arg-type]
    assert transport.commands and "kill -INT" in transport.commands[0]
    assert transport.seen_elsewhere == [True]
    assert cancel.requested()


def test_stop_without_ctrl_c_leaves_the_flag_down() -> None:
    transport = Watching()
    _Run(transport, "raycluster-demo-head").stop()  # type: ignore[arg-type]
    assert transport.seen_elsewhere == [False] and not cancel.requested()
