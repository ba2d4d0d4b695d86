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

    def __init__(self, host: str, message: str, hint: str = "") -> None:
        super().__init__(f"{host}: {message}", hint)
        self.host = host


class HostKeyError(TransportError):
    """The host's SSH key is unknown (strict mode) or has changed."""


class AuthError(TransportError):
    """SSH authentication failed."""


class OperationError(RayclusterError):
    """An operation on the cluster failed (a container did not start, a node did not join, ...)."""
