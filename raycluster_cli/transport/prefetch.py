"""A read-only command started right after the login, before the CLI asks for it (the 1-host verbs' start).

On one host, `status` and `doctor` each begin with one read-only command per host (status's look at the
container, doctor's facts batch): 0.2 s on the host that the CLI used to wait for after its imports. When the
last run of the same command line on the same inventory began with such a command on a host, logins.py starts
it again as soon as that host's login ends, and the CLI's own call gets its result (`SSHTransport.run`).

Only commands the code declares read-only are ever kept or started: the caller runs them inside `read_only()`,
and the transport records the first such command per host (`SSHTransport.first_read_only`). The facts batch
carries a random marker (so no output can forge its frames); it is kept with the marker blanked, started with
a fresh one, and its output handed over with the caller's marker in its place (`rebrand`): the output was made
before the caller's marker existed, so it cannot contain it either.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from raycluster_cli.transport.base import CommandResult

MARKER_PREFIX = "@@raycluster-facts-"
_MARKER = re.compile(re.escape(MARKER_PREFIX) + r"[0-9a-f]{12}")
_BLANK = MARKER_PREFIX + "************"
_local = threading.local()


def new_marker() -> str:
    """A facts batch's marker: a random nonce no command output can guess."""
    return MARKER_PREFIX + secrets.token_hex(6)


@contextmanager
def read_only() -> Iterator[None]:
    """Declare the commands run in this block (this thread) read-only: they may be started ahead next time."""
    before = getattr(_local, "read_only", False)
    _local.read_only = True
    try:
        yield
    finally:
        _local.read_only = before


def declared_read_only() -> bool:
    return bool(getattr(_local, "read_only", False))


def shape(command: str) -> tuple[str, str | None]:
    """The command with its batch marker blanked, and that marker (None: it has none)."""
    found = _MARKER.search(command)
    if found is None:
        return command, None
    return command.replace(found.group(0), _BLANK), found.group(0)


def fill(blanked: str) -> tuple[str, str | None]:
    """A kept command made runnable: a fresh marker where it was blanked (and that marker)."""
    if _BLANK not in blanked:
        return blanked, None
    marker = new_marker()
    return blanked.replace(_BLANK, marker), marker


def rebrand(result: CommandResult, ran: str | None, wanted: str | None) -> CommandResult:
    """The output of a command run with marker `ran`, as the caller's command (marker `wanted`) would print it."""
    if ran is None or wanted is None or ran == wanted:
        return result
    return CommandResult(
        result.rc, result.stdout.replace(ran, wanted), result.stderr.replace(ran, wanted), result.window
    )


class Pending:
    """A command to start ahead on one host: its result once it ended (None: it failed to run at all).

    Whoever claims it first runs it: the thread that starts it after the login, or the CLI's own call when
    it comes first (the login is slow, or never got to this host). A call that finds it claimed by the other
    waits for it to end, which the command's own deadline bounds."""

    def __init__(self, marker: str | None) -> None:
        self.marker = marker
        self.done = threading.Event()
        self.result: CommandResult | None = None
        self.error: BaseException | None = None  # the host stopped answering under it: the CLI's call raises it
        self._lock = threading.Lock()
        self._claimed = False

    def claim(self) -> bool:
        """True for the first caller only."""
        with self._lock:
            claimed, self._claimed = self._claimed, True
            return not claimed
