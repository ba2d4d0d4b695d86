"""A transport that answers from a table (for unit tests): the first regex that matches wins."""

from __future__ import annotations

import re
from collections.abc import Mapping

from .base import CommandResult


class FakeTransport:
    def __init__(self, host: str, table: Mapping[str, CommandResult | str]) -> None:
        self.host = host
        self.table = [
            (re.compile(k), v if isinstance(v, CommandResult) else CommandResult(0, v, "")) for k, v in table.items()
        ]
        self.commands: list[str] = []
        self.files: dict[str, tuple[bytes, int]] = {}

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 120.0) -> CommandResult:
        self.commands.append(command)
        for pattern, result in self.table:
            if pattern.search(command):
                return result
        return CommandResult(127, "", f"fake: no answer for {command!r}")

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        self.files[path] = (data, mode)

    def close(self) -> None:
        pass
