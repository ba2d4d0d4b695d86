"""Errors that reach the user as one line with a fix, and the exit codes of every verb."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes of every `raycluster` verb (documented in the README)."""

    OK = 0
    FAILED = 1  # an operation or a check failed
    USAGE = 2  # bad flags or a bad inventory
    INTERRUPTED = 130  # Ctrl-C


class RayclusterError(Exception):
    """An error the user can act on: `message` says what happened, `hint` says what to do."""

    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        return f"{self.message} — {self.hint}" if self.hint else self.message


class InventoryError(RayclusterError):
    """The inventory file is missing, unreadable or invalid."""

    exit_code = ExitCode.USAGE


class UsageError(RayclusterError):
    """A flag or argument is wrong."""

    exit_code = ExitCode.USAGE


class TransportError(RayclusterError):
    """A host could not be reached or a command could not be run on it."""

    transient = False  # True when a retry may help (refused or reset while booting, no banner yet)
    silent = False  # True when the host said nothing at all (no SSH banner, no answer on the port)

    def __init__(self, host: str, message: str, hint: str = "") -> None:
        super().__init__(f"{host}: {message}", hint)
        self.host = host


class HostStoppedAnswering(TransportError):
    """The connection died under a command because the host stopped answering (keepalive, or no channel)."""


STOPPED_ANSWERING_HINT = "check that the host is up and not frozen (console, load); re-run when it answers"


class HostKeyError(TransportError):
    """The host's SSH key is unknown (strict mode) or has changed."""


class AuthError(TransportError):
    """SSH authentication failed."""


class OperationError(RayclusterError):
    """An operation on the cluster failed (a container did not start, a node did not join, ...)."""


class GroupError(OperationError):
    """Several hosts failed in one step: every one of them is named (none hides the others).

    `failures` holds (host, error) pairs; the message lists each host's own one-line error, the hint is the
    first failure's own hint (they are usually alike), and the exit code is the most severe one among them.
    """

    def __init__(self, what: str, failures: list[tuple[str, BaseException]]) -> None:
        self.failures = failures
        parts = [f"{host}: {error_text(error).removeprefix(f'{host}: ')}" for host, error in failures]
        head = f"{len(failures)} host(s) failed" + (f" to {what}" if what else "")
        hints = [error.hint for _, error in failures if isinstance(error, RayclusterError) and error.hint]
        super().__init__(f"{head}: " + "; ".join(parts), hints[0] if hints else "see each host's message")
        codes = [error.exit_code for _, error in failures if isinstance(error, RayclusterError)]
        self.exit_code = max(codes, default=ExitCode.FAILED)

    def details(self) -> list[dict[str, str]]:
        """One entry per failed host, for the JSON document."""
        return [
            {
                "host": host,
                "error": error_text(error).removeprefix(f"{host}: "),
                "hint": error.hint if isinstance(error, RayclusterError) else "",
            }
            for host, error in self.failures
        ]


def error_text(error: BaseException) -> str:
    """The one-line text of any error: a RayclusterError's message, else the exception's type and text."""
    if isinstance(error, RayclusterError):
        return error.message
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
