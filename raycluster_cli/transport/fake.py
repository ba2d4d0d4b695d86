"""A transport that answers from a table (for unit tests): the first regex that matches wins.

A batch of commands (transport/batch.py) is answered command by command, so the table keeps one entry per
command; `commands` lists what ran (a batch's commands one by one) and `round_trips` counts remote commands.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import BinaryIO

from raycluster_cli.transport.base import CommandResult
from raycluster_cli.transport.batch import fake_batch_output, split_batch


class FakeTransport:
    def __init__(self, host: str, table: Mapping[str, CommandResult | str]) -> None:
        self.host = host
        self.table = [
            (re.compile(k), v if isinstance(v, CommandResult) else CommandResult(0, v, "")) for k, v in table.items()
        ]
        self.commands: list[str] = []
        self.files: dict[str, tuple[bytes, int]] = {}
        self.fed: dict[str, bytes] = {}
        self.round_trips = 0

    def run(
        self,
        command: str,
        *,
        stdin: bytes | None = None,
        timeout: float | None = 120.0,
        on_line: Callable[[str], None] | None = None,
    ) -> CommandResult:
        self.round_trips += 1
        if split_batch(command) is not None:
            return fake_batch_output(command, self.answer)
        return _told(self.answer(command), on_line)

    def answer(self, command: str) -> CommandResult:
        """The table's answer to one command (recorded in `commands`)."""
        self.commands.append(command)
        for pattern, result in self.table:
            if pattern.search(command):
                return result
        return CommandResult(127, "", f"fake: no answer for {command!r}")

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        self.round_trips += 1
        self.files[path] = (data, mode)

    def feed(
        self,
        command: str,
        source: BinaryIO,
        *,
        on_sent: Callable[[int], None] | None = None,
        timeout: float | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> CommandResult:
        data = source.read()
        self.fed[command] = data
        if on_sent is not None:
            on_sent(len(data))
        self.round_trips += 1
        return _told(self.answer(command), on_line)

    def close(self) -> None:
        pass


def _told(result: CommandResult, on_line: Callable[[str], None] | None) -> CommandResult:
    """Each line of the answer's stdout goes to `on_line` (all at once here: the answer is ready-made)."""
    if on_line is not None:
        for line in result.stdout.splitlines():
            on_line(line)
    return result
