"""Run commands on this machine (the operator's), with the same interface as SSH."""

from __future__ import annotations

import subprocess

from ..errors import TransportError
from .base import CommandResult, put_command


class LocalTransport:
    def __init__(self, host: str = "localhost") -> None:
        self.host = host

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 120.0) -> CommandResult:
        try:
            done = subprocess.run(["/bin/sh", "-c", command], input=stdin or b"", capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TransportError(self.host, f"a command ran past {timeout}s", "see --debug for it") from None
        return CommandResult(
            done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
        )

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        result = self.run(put_command(path, mode), stdin=data)
        if not result.ok:
            raise TransportError(self.host, f"cannot write {path}: {result.first_line()}", "check permissions")

    def close(self) -> None:
        pass
