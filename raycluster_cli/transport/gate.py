"""The login gate and the record of a login started ahead: shared by the SSH pool (pool.py) and the logins
started from the last run's routes before the inventory is read (logins.py), so neither imports the other.

Light on purpose: no inventory (pydantic), no engine; only what a login needs before the CLI's imports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

from raycluster_cli import cancel

STAGGER_S = 0.01  # between the starts of two logins


class LoginGate:
    """A bounded, staggered gate around SSH logins (a context manager shared by every connection)."""

    def __init__(self, parallel: int, stagger_s: float = STAGGER_S) -> None:
        self._slots = threading.BoundedSemaphore(max(1, parallel))
        self._lock = threading.Lock()
        self._stagger_s = stagger_s
        self._next_start = 0.0

    def __enter__(self) -> None:
        while not self._slots.acquire(timeout=0.2):
            cancel.check("logging in")
        with self._lock:
            now = time.monotonic()
            wait = self._next_start - now
            self._next_start = max(now, self._next_start) + self._stagger_s
        if wait > 0:
            time.sleep(wait)

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._slots.release()


class Ahead:
    """One host's login started before its first use: whether a thread took it, when it ended, its failure."""

    def __init__(self) -> None:
        self.started = False
        self.done = threading.Event()
        self.error: BaseException | None = None

    def attempt(self, log_in: Callable[[], None]) -> None:
        """Run the login; its failure is kept for the host's first user (never raised in the login's thread)."""
        try:
            log_in()
        except BaseException as exc:
            self.error = exc
