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
import time
from collections.abc import Callable

import paramiko

log = logging.getLogger("raycluster.transport")


class KeepAlive:
    """One daemon thread per connection; `dead_after` says why it closed the connection (0: it did not).

    As OpenSSH's ServerAlive*, any packet received from the host proves it alive (during an image stream
    its window adjustments arrive all the time, and a keepalive reply could queue behind megabytes of
    data); only after `interval` seconds of silence does a keepalive that wants a reply go out, and after
    `interval × count` seconds of silence the host is declared dead.
    """

    def __init__(
        self, transport: paramiko.Transport, host: str, interval: float, count: int, on_dead: Callable[[], None]
    ) -> None:
        self.transport = transport
        self.host = host
        self.interval = interval
        self.count = count
        self.on_dead = on_dead
        self.dead_after = 0.0
        self.last_heard = time.monotonic()
        self._asking = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"keepalive-{host}", daemon=True)
        self._hear_everything(transport)

    def _hear_everything(self, transport: paramiko.Transport) -> None:
        """Note the time of every packet the host sends (paramiko's transport thread reads them all)."""
        packetizer = transport.packetizer
        read = packetizer.read_message

        def read_and_note() -> object:
            message = read()
            self.last_heard = time.monotonic()
            return message

        packetizer.read_message = read_and_note  # type: ignore[method-assign,assignment]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    @property
    def declared_dead(self) -> bool:
        return self.dead_after > 0

    def _run(self) -> None:
        limit = self.interval * self.count
        while not self._stop.wait(self.interval / 2):
            if not self.transport.is_active():
                return
            silent = time.monotonic() - self.last_heard
            if silent >= limit:
                self.dead_after = limit
                log.debug("%s: nothing heard for %.0fs: closing the connection", self.host, silent)
                self.on_dead()
                return
            if silent >= self.interval and not self._asking.is_set():
                self._asking.set()
                threading.Thread(target=self._ask, name=f"keepalive-ask-{self.host}", daemon=True).start()

    def _ask(self) -> None:
        # sshd answers an unknown global request with "failure": any answer proves the host is alive (the
        # reply is noted by the read hook). An error means the connection is going away; whoever uses it
        # next reports that.
        with contextlib.suppress(Exception):
            self.transport.global_request("keepalive@openssh.com", wait=True)
        self._asking.clear()
