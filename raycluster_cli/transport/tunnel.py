"""A local port forwarded over a host's SSH connection (paramiko `direct-tcpip`), as `ssh -L` does.

A listener on 127.0.0.1 accepts connections; each one gets its own channel to DEST:PORT as the SSH host
sees it (the head's dashboard listens on the head's own address, which the operator may not reach).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Callable

import paramiko

from raycluster_cli.errors import STOPPED_ANSWERING_HINT, HostStoppedAnswering, TransportError, UsageError

ChannelOpener = Callable[[tuple[str, int]], paramiko.Channel]
OPEN_TIMEOUT_S = 15.0


def forward_opener(transport: object, host: str, dest: tuple[str, int]) -> ChannelOpener:
    """Channels to `dest` as `host` sees it, over `transport` (an SSH transport: `paramiko_transport()`)."""
    get = getattr(transport, "paramiko_transport", None)
    if get is None:
        raise TransportError(host, "port forwarding needs an SSH connection", "use an SSH inventory")

    def open_to(origin: tuple[str, int]) -> paramiko.Channel:
        try:
            channel: paramiko.Channel = get().open_channel("direct-tcpip", dest, origin, timeout=OPEN_TIMEOUT_S)
            return channel
        except paramiko.ChannelException as exc:
            raise TransportError(
                host,
                f"sshd could not connect to {dest[0]}:{dest[1]} ({exc.text or exc})",
                "is the cluster up? `raycluster status`",
            ) from None
        except (EOFError, paramiko.SSHException, OSError) as exc:
            lost = getattr(transport, "stopped_answering", lambda: None)()
            if lost:  # the keepalive closed the connection under the request: say that, not "channel failed"
                raise HostStoppedAnswering(
                    host, f"{lost} while opening a channel to {dest[0]}:{dest[1]}", STOPPED_ANSWERING_HINT
                ) from None
            raise TransportError(
                host, f"cannot open a forwarded channel: {exc}", "check AllowTcpForwarding in the host's sshd_config"
            ) from None

    return open_to


class Tunnel:
    """127.0.0.1:`local_port` (0: any free port) → `dest` through `open_to(origin)` channels."""

    def __init__(self, open_to: ChannelOpener, local_port: int = 0) -> None:
        self.open_to = open_to
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.listener.bind(("127.0.0.1", local_port))
        except OSError as exc:
            self.listener.close()
            raise UsageError(
                f"cannot listen on 127.0.0.1:{local_port}: {exc.strerror}", "pick another --port (0: any free one)"
            ) from None
        self.listener.listen(16)
        self.listener.settimeout(0.5)
        self.port = int(self.listener.getsockname()[1])
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="tunnel-accept", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, origin = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client, origin), daemon=True).start()

    def _serve(self, client: socket.socket, origin: tuple[str, int]) -> None:
        try:
            channel = self.open_to(origin)
        except TransportError as exc:
            self.errors.append(exc.one_line())
            client.close()
            return
        try:
            _pump(client, channel, self._stop)
        finally:
            channel.close()
            client.close()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        self._thread.join(timeout=2)

    def __enter__(self) -> Tunnel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pump(client: socket.socket, channel: paramiko.Channel, stop: threading.Event) -> None:
    """Copy bytes both ways until either side closes."""
    while not stop.is_set():
        readable, _, _ = select.select([client.fileno(), channel.fileno()], [], [], 0.5)
        if client.fileno() in readable:
            data = client.recv(65536)
            if not data:
                return
            channel.sendall(data)
        if channel.fileno() in readable:
            data = channel.recv(65536)
            if not data:
                return
            client.sendall(data)
