"""Run commands on this machine (the operator's), with the same interface as SSH."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import BinaryIO

from ..errors import TransportError
from .base import CHUNK, CommandResult, put_command


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

    def feed(
        self,
        command: str,
        source: BinaryIO,
        *,
        on_sent: Callable[[int], None] | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        with subprocess.Popen(
            ["/bin/sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        ) as process:
            assert process.stdin is not None
            try:
                while chunk := source.read(CHUNK):
                    process.stdin.write(chunk)
                    if on_sent is not None:
                        on_sent(len(chunk))
            except BrokenPipeError:
                pass  # the command ended early; its exit status says why
            out, err = process.communicate(timeout=timeout)
        return CommandResult(process.returncode, out.decode(errors="replace"), err.decode(errors="replace"))

    def close(self) -> None:
        pass
