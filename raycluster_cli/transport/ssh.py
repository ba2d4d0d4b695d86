"""SSH transport over paramiko with host keys verified.

`strict` refuses a host whose key is not in known_hosts; `accept-new` records an unknown key (and still
refuses a changed one). Every failure becomes a TransportError that names the host and the fix.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import paramiko

from ..errors import AuthError, HostKeyError, TransportError
from .base import CHUNK, CommandResult, put_command


class _AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
    """Record an unknown host key in the known_hosts file (like OpenSSH's accept-new)."""

    def __init__(self, known_hosts_file: Path) -> None:
        self.known_hosts_file = known_hosts_file
        self.lock = threading.Lock()

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        with self.lock:
            self.known_hosts_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with self.known_hosts_file.open("a") as handle:
                handle.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class SSHTransport:
    def __init__(
        self,
        host: str,
        *,
        user: str = "root",
        port: int = 22,
        key_file: str | None = None,
        known_hosts: str = "strict",
        known_hosts_file: str = "~/.ssh/known_hosts",
        connect_timeout: float = 10.0,
    ) -> None:
        self.host = host
        self.user = user
        self.port = port
        self.key_file = os.path.expanduser(key_file) if key_file else None
        self.known_hosts = known_hosts
        self.known_hosts_file = Path(os.path.expanduser(known_hosts_file))
        self.connect_timeout = connect_timeout
        self._client: paramiko.SSHClient | None = None

    @property
    def _target(self) -> str:
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    def connect(self) -> None:
        if self._client is not None:
            return
        if self.key_file and not os.path.exists(self.key_file):
            raise AuthError(self.host, f"SSH key {self.key_file} does not exist", "fix ssh.key in the inventory")
        client = paramiko.SSHClient()
        if self.known_hosts_file.exists():
            client.load_host_keys(str(self.known_hosts_file))
        if self.known_hosts == "accept-new":
            client.set_missing_host_key_policy(_AcceptNewPolicy(self.known_hosts_file))
        else:
            client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            client.connect(
                self.host,
                port=self.port,
                username=self.user,
                key_filename=self.key_file,
                timeout=self.connect_timeout,
                banner_timeout=self.connect_timeout,
                auth_timeout=self.connect_timeout,
                allow_agent=self.key_file is None,
                look_for_keys=self.key_file is None,
            )
        except paramiko.BadHostKeyException:
            client.close()
            raise HostKeyError(
                self.host,
                "SSH host key has CHANGED since it was recorded (possible man-in-the-middle)",
                f"if the host was reinstalled: ssh-keygen -f {self.known_hosts_file} -R '{self._target}'",
            ) from None
        except paramiko.AuthenticationException:
            client.close()
            raise AuthError(
                self.host,
                f"SSH authentication failed (user={self.user}, key={self.key_file or 'agent/default keys'})",
                f"install the public key in ~{self.user}/.ssh/authorized_keys on {self.host}, or fix ssh.user/ssh.key",
            ) from None
        except paramiko.SSHException as exc:
            client.close()
            if "known_hosts" in str(exc):
                raise HostKeyError(
                    self.host,
                    f"SSH host key is not in {self.known_hosts_file} (ssh.known_hosts: strict)",
                    f"verify and record it: ssh-keyscan -p {self.port} {self.host} >> {self.known_hosts_file}, "
                    "or set ssh.known_hosts: accept-new",
                ) from None
            raise TransportError(self.host, f"SSH failed: {exc}", "check sshd on the host") from None
        except TimeoutError:
            client.close()
            raise TransportError(
                self.host,
                f"no answer on port {self.port} within {self.connect_timeout:.0f}s (host down or filtered)",
                "check the address, that the host is up, and firewalls between here and it",
            ) from None
        except paramiko.ssh_exception.NoValidConnectionsError:
            client.close()
            raise TransportError(
                self.host, f"connection refused on port {self.port}", "start sshd on the host or fix ssh.port"
            ) from None
        except OSError as exc:
            client.close()
            raise TransportError(
                self.host, f"cannot connect: {exc.strerror or exc}", "check the address and the route to it"
            ) from None
        self._client = client

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 120.0) -> CommandResult:
        channel = self._open_channel()
        try:
            channel.exec_command(command)
            if stdin is not None:
                channel.sendall(stdin)
            channel.shutdown_write()
            return self._collect(channel, timeout)
        except (EOFError, paramiko.SSHException, OSError) as exc:
            raise self._dropped(exc) from None
        finally:
            channel.close()

    def _open_channel(self, **options: int) -> paramiko.Channel:
        """A session on this host's connection (made on first use); a lost connection is forgotten and reported."""
        self.connect()
        assert self._client is not None
        transport = self._client.get_transport()
        if transport is None or not transport.is_active():
            self.close()
            raise TransportError(self.host, "SSH connection was lost", "check the host and retry")
        try:
            return transport.open_session(**options)
        except (EOFError, paramiko.SSHException, OSError) as exc:
            raise self._dropped(exc) from None

    def paramiko_transport(self) -> paramiko.Transport:
        """This host's live SSH connection (made on first use): for forwarded ports and streamed sessions."""
        self.connect()
        assert self._client is not None
        transport = self._client.get_transport()
        if transport is None or not transport.is_active():
            self.close()
            raise TransportError(self.host, "SSH connection was lost", "check the host and retry")
        return transport

    def _dropped(self, exc: BaseException) -> TransportError:
        """The connection died under a command: forget it (the next call reconnects) and say so in one line."""
        self.close()
        return TransportError(
            self.host,
            f"the SSH connection dropped during a command ({type(exc).__name__}: {exc or 'no detail'})",
            "re-run; if it repeats, check sshd (MaxStartups, MaxSessions) and free memory on the host",
        )

    def feed(
        self,
        command: str,
        source: BinaryIO,
        *,
        on_sent: Callable[[int], None] | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        channel = self._open_channel(window_size=8 * 1024 * 1024, max_packet_size=256 * 1024)
        out, err = bytearray(), bytearray()
        try:
            channel.exec_command(command)
            while chunk := source.read(CHUNK):
                # Drain what the command says meanwhile, so that a chatty command never blocks the stream.
                while channel.recv_ready():
                    out += channel.recv(65536)
                while channel.recv_stderr_ready():
                    err += channel.recv_stderr(65536)
                if channel.exit_status_ready():
                    break  # the command ended early (it failed): stop sending
                channel.sendall(chunk)
                if on_sent is not None:
                    on_sent(len(chunk))
            channel.shutdown_write()
            rest = self._collect(channel, timeout)
        finally:
            channel.close()
        return CommandResult(
            rest.rc, out.decode(errors="replace") + rest.stdout, err.decode(errors="replace") + rest.stderr
        )

    def _collect(self, channel: paramiko.Channel, timeout: float | None) -> CommandResult:
        return collect(channel, timeout, self.host)

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        result = self.run(put_command(path, mode), stdin=data)
        if not result.ok:
            raise TransportError(self.host, f"cannot write {path}: {result.first_line()}", "check disk and permissions")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


# How long to wait for the end of the output once the command has exited: sshd may send the exit status
# before the last of the output, and a command that leaves a daemon holding its stdout never sends EOF.
EOF_GRACE_S = 2.0


def collect(channel: paramiko.Channel, timeout: float | None, host: str) -> CommandResult:
    """Read a command's stdout and stderr until its output ends (EOF), not merely until it exits."""
    out, err = bytearray(), bytearray()
    deadline = None if timeout is None else time.monotonic() + timeout
    exited_at: float | None = None
    channel.settimeout(0.2)
    while True:
        got = False
        if channel.recv_ready():
            out += channel.recv(65536)
            got = True
        if channel.recv_stderr_ready():
            err += channel.recv_stderr(65536)
            got = True
        if got:
            continue
        if channel.exit_status_ready():
            exited_at = exited_at or time.monotonic()
            drained = not channel.recv_ready() and not channel.recv_stderr_ready()
            if drained and (channel.eof_received or time.monotonic() - exited_at > EOF_GRACE_S):
                break
        if deadline is not None and time.monotonic() > deadline:
            raise TransportError(host, f"a command ran past {timeout:.0f}s", "see --debug for it")
        time.sleep(0.01)
    return CommandResult(channel.recv_exit_status(), out.decode(errors="replace"), err.decode(errors="replace"))
