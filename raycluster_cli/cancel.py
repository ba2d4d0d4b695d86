"""One process-wide cancellation flag: set by SIGINT/SIGTERM, checked before every piece of host work.

Library code never installs signal handlers; the CLI does, and calls `request()`. Transports poll
`requested()` in their blocking loops and raise `Cancelled`; the fan-out starts no queued item once it is set.
"""

from __future__ import annotations

import threading

_EVENT = threading.Event()


class Cancelled(KeyboardInterrupt):
    """The operator interrupted the run: raised where host work stops (a KeyboardInterrupt, so no
    `except Exception` swallows it)."""


def request() -> None:
    """Ask every running and queued piece of host work to stop."""
    _EVENT.set()


def requested() -> bool:
    return _EVENT.is_set()


def check(what: str = "") -> None:
    """Raise Cancelled if the run was interrupted (call before starting `what`)."""
    if _EVENT.is_set():
        raise Cancelled(f"interrupted before {what}" if what else "interrupted")


def wait(seconds: float) -> bool:
    """Sleep up to `seconds`; True (at once) when the run is interrupted meanwhile."""
    return _EVENT.wait(seconds)


def reset() -> None:
    """Clear the flag (tests, and a library caller that runs several operations in one process)."""
    _EVENT.clear()
