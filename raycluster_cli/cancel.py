"""One process-wide cancellation flag: set by SIGINT/SIGTERM, checked before every piece of host work.

Library code never installs signal handlers; the CLI does, and calls `request()`. Transports poll
`requested()` in their blocking loops and raise `Cancelled`; the fan-out starts no queued item once it is set.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

_EVENT = threading.Event()
_THREAD = threading.local()  # .exempt: this thread's own work goes on after an interrupt (see `exempt`)


class Cancelled(KeyboardInterrupt):
    """The operator interrupted the run: raised where host work stops (a KeyboardInterrupt, so no
    `except Exception` swallows it)."""


def request() -> None:
    """Ask every running and queued piece of host work to stop."""
    _EVENT.set()


def requested() -> bool:
    return _EVENT.is_set() and not getattr(_THREAD, "exempt", False)


@contextlib.contextmanager
def exempt() -> Iterator[None]:
    """Let this thread's work inside the block run although the run was interrupted (a clean-up command that
    must still reach a host), while every other thread keeps seeing the flag."""
    before = getattr(_THREAD, "exempt", False)
    _THREAD.exempt = True
    try:
        yield
    finally:
        _THREAD.exempt = before


def check(what: str = "") -> None:
    """Raise Cancelled if the run was interrupted (call before starting `what`)."""
    if requested():
        raise Cancelled(f"interrupted before {what}" if what else "interrupted")


def wait(seconds: float) -> bool:
    """Sleep up to `seconds`; True (at once) when the run is interrupted meanwhile."""
    if getattr(_THREAD, "exempt", False):
        time.sleep(seconds)
        return False
    return _EVENT.wait(seconds)


def reset() -> None:
    """Clear the flag (tests, and a library caller that runs several operations in one process)."""
    _EVENT.clear()
