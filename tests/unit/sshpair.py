"""A real SSH server (paramiko's) on one end of a socket pair, for unit tests that log in for real without a
network: the client end goes to SSHTransport as its `sock`. Each exec request is handed to `on_exec`."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import paramiko

Exec = Callable[[paramiko.Channel, str], None]  # runs in its own thread; the channel is closed after


class _Server(paramiko.ServerInterface):
    def __init__(self, on_exec: Exec | None, hold_exec: threading.Event | None) -> None:
        self.on_exec = on_exec
        self.hold_exec = hold_exec

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        return paramiko.AUTH_SUCCESSFUL

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return paramiko.OPEN_SUCCEEDED if kind == "session" else paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel: paramiko.Channel, command: bytes) -> bool:
        if self.hold_exec is not None:
            self.hold_exec.wait()  # an sshd that never answers the request (it blocks this transport's thread)
        if self.on_exec is None:
            return False
        threading.Thread(target=self._run, args=(channel, command.decode()), daemon=True).start()
        return True

    def _run(self, channel: paramiko.Channel, command: str) -> None:
        try:
            assert self.on_exec is not None
            self.on_exec(channel, command)
        except Exception:  # the client went away under it
            pass
        finally:
            channel.close()


class Pair:
    """One SSH server per `sock()` call: `sock` is what SSHTransport takes."""

    def __init__(self, tmp: Path, on_exec: Exec | None = None, hold_exec: threading.Event | None = None) -> None:
        self.host_key = paramiko.ECDSAKey.generate()
        self.client_key_file = tmp / "id_ecdsa"
        paramiko.ECDSAKey.generate().write_private_key_file(str(self.client_key_file))
        self.on_exec, self.hold_exec = on_exec, hold_exec
        self.servers: list[paramiko.Transport] = []

    def known_line(self, name: str = "192.0.2.1") -> str:
        return f"{name} {self.host_key.get_name()} {self.host_key.get_base64()}\n"

    def sock(self, timeout: float) -> socket.socket:
        client, server = socket.socketpair()
        transport = paramiko.Transport(server)
        transport.add_server_key(self.host_key)
        self.servers.append(transport)
        server_side = _Server(self.on_exec, self.hold_exec)

        def serve() -> None:  # start_server waits for the client's key exchange
            with contextlib.suppress(paramiko.SSHException, EOFError, OSError):  # a refused login ends it
                transport.start_server(server=server_side)

        start = threading.Thread(target=serve, daemon=True)
        start.start()
        return client

    def close(self) -> None:
        if self.hold_exec is not None:
            self.hold_exec.set()
        for transport in self.servers:
            transport.close()
