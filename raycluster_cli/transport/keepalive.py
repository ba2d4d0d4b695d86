"""OpenSSH's ServerAliveInterval/ServerAliveCountMax for a paramiko connection.

paramiko's own `Transport.set_keepalive` sends requests that want no reply, so it never notices a host
that stopped answering (a wedged kernel, a cut cable): TCP stays open and every read waits. Here a request
that *wants* a reply goes out every `interval` seconds; when none comes back within `interval × count`
seconds the connection is declared dead and closed, which ends every read, write and channel open on it
at once — a command that runs for an hour on a live host is fine, a host that froze is noticed in seconds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import paramiko

log = logging.getLogger("raycluster.transport")


class KeepAlive:
    """One daemon thread per connection; `dead_after` says why it closed the connection (or "")."""

    def __init__(
        self, transport: paramiko.Transport, host: str, interval: float, count: int, on_dead: Callable[[], None]
    ) -> None:
        self.transport = transport
        self.host = host
        self.interval = interval
        self.count = count
        self.on_dead = on_dead
        self.dead_after = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"keepalive-{host}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def declared_dead(self) -> bool:
        return self.dead_after > 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if not self.transport.is_active():
                return
            answered = threading.Event()
            threading.Thread(target=self._ask, args=(answered,), name=f"keepalive-ask-{self.host}", daemon=True).start()
            limit = self.interval * self.count
            if not answered.wait(limit) and not self._stop.is_set() and self.transport.is_active():
                self.dead_after = limit
                log.debug("%s: no answer to keepalives for %.0fs: closing the connection", self.host, limit)
                self.on_dead()
                return

    def _ask(self, answered: threading.Event) -> None:
        # sshd answers an unknown global request with "failure": any answer proves the host is alive. An
        # error means the connection is going away; whoever uses it next reports that.
        with contextlib.suppress(Exception):
            self.transport.global_request("keepalive@openssh.com", wait=True)
        answered.set()
