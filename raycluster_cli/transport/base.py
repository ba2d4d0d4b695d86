"""The one protocol every transport implements."""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

CHUNK = 256 * 1024


@dataclass(frozen=True)
class CommandResult:
    rc: int
    stdout: str
    stderr: str
    # The operator's wall clock when the command was sent and its output received, set only when it ran before
    # the caller asked (started ahead, see prefetch.py): a caller that times the command uses these instead.
    window: tuple[float, float] | None = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def first_line(self) -> str:
        """The first non-empty line of stderr (else stdout): what to show a user on failure."""
        for text in (self.stderr, self.stdout):
            for line in text.splitlines():
                if line.strip():
                    return line.strip()[:300]
        return f"exit status {self.rc}"


class Transport(Protocol):
    """A host we can run shell commands on."""

    host: str

    def run(
        self,
        command: str,
        *,
        stdin: bytes | None = None,
        timeout: float | None = 120.0,
        on_line: Callable[[str], None] | None = None,
    ) -> CommandResult:
        """Run `command` in a POSIX shell; never raises for a non-zero exit (only for a lost host). With
        `on_line`, each line of its stdout is handed over as soon as it is whole (it is kept in the result too)."""
        ...

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        """Write `data` to `path` atomically with `mode`, creating missing folders: the file's own folder 0700,
        the folders above it 0755 (as hoststate makes a cluster's folder and the state root)."""
        ...

    def feed(
        self,
        command: str,
        source: BinaryIO,
        *,
        on_sent: Callable[[int], None] | None = None,
        timeout: float | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> CommandResult:
        """Run `command` with `source` streamed to its stdin in chunks (for data too big to hold in memory);
        `on_sent(n)` after each chunk of n bytes; `on_line` as for `run`."""
        ...

    def close(self) -> None: ...


def quote(*parts: object) -> str:
    """Join arguments into a shell command line, each quoted."""
    return " ".join(shlex.quote(str(p)) for p in parts)


# Printed between the parts of one remote command whose outputs are read apart (`echo PART_SEPARATOR`).
PART_SEPARATOR = "--raycluster--"


def shell_path(path: str) -> str:
    """A host path as one shell word: `~/rest` becomes `"$HOME"/rest` (the login user's home on that host)."""
    if path == "~" or path.startswith("~/"):
        rest = path[2:]
        return '"$HOME"' + (f"/{shlex.quote(rest)}" if rest else "")
    return shlex.quote(path)


def put_command(path: str, mode: int) -> str:
    """The shell command that `put` runs with the data on stdin (data never on a command line).

    `path` may start with `~/` (the login user's home on the host). A missing folder on the way is made as
    hoststate makes them: only the file's own folder is private (0700); those above it are 0755, so a
    shared folder (`/etc/raycluster`) made by root under `umask 077` never locks another login out. The
    file is written 0600 from the start, then given `mode`; existing folders keep their modes."""
    directory = posixpath.dirname(path) or "."
    above = posixpath.dirname(directory)
    shared = f"(umask 022 && mkdir -p -- {shell_path(above)}) && " if above else ""
    tmp = shell_path(f"{path}.raycluster-tmp")
    return (
        f"{shared}umask 077 && mkdir -p -- {shell_path(directory)} && cat > {tmp} && "
        f"chmod {mode:o} {tmp} && mv -f -- {tmp} {shell_path(path)}"
    )
