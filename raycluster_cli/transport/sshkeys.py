"""Which key logs in, and what a failed login means — as OpenSSH does it, in one line with the fix.

No `ssh.key`: the SSH agent, then the default keys (~/.ssh/id_ed25519, id_ecdsa, id_rsa). A key protected
by a passphrase: the agent (`ssh-add`), or the passphrase in $RAYCLUSTER_SSH_PASSPHRASE — never on a
command line. `connect_error` turns whatever paramiko raised while connecting into a TransportError that
says whether a retry can help (`transient`: refused or reset while booting, no banner yet) or not
(authentication, host keys).
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Protocol

import paramiko

from raycluster_cli.errors import AuthError, HostKeyError, TransportError


class Login(Protocol):
    """What a login's errors name: the SSH transport (ssh.py) as these functions read it."""

    host: str
    user: str
    port: int
    key_file: str | None
    known_hosts_file: Path
    connect_timeout: float

    @property
    def target(self) -> str: ...  # the host as known_hosts names it: HOST, or [HOST]:PORT


PASSPHRASE_ENV = "RAYCLUSTER_SSH_PASSPHRASE"
# What paramiko says when the host accepted the TCP connection but its sshd did not finish the handshake in
# time (the banner timeout fires in paramiko's own thread; the login then finds no session).
_HANDSHAKE_STALLED = ("Error reading SSH protocol banner", "No existing session", "Negotiation timed out")
_lock = threading.Lock()
_keys: dict[str, paramiko.PKey | None] = {}  # path → decrypted key, or None: leave it to the agent
_encrypted: set[str] = set()


def passphrase() -> str | None:
    return os.environ.get(PASSPHRASE_ENV) or None


def agent_has_keys() -> bool:
    if not os.environ.get("SSH_AUTH_SOCK"):
        return False
    try:
        agent = paramiko.Agent()
        try:
            return bool(agent.get_keys())
        finally:
            agent.close()
    except Exception:  # an agent socket that does not answer is no agent
        return False


def load(path: str, host: str) -> paramiko.PKey | None:
    """The private key at `path` (read once per run), or None when it is encrypted and the agent holds keys."""
    with _lock:
        if path in _keys:
            return _keys[path]
        _keys[path] = key = _read(path, host)
        return key


def _read(path: str, host: str) -> paramiko.PKey | None:
    file = Path(path)
    if not file.exists():
        raise AuthError(
            host,
            f"ssh.key {path} does not exist",
            "fix ssh.key in the inventory, or remove it to use the SSH agent and the default keys (~/.ssh/id_*)",
        )
    if file.is_dir():
        raise AuthError(
            host, f"ssh.key {path} is a directory", "point ssh.key at the private key file, e.g. ~/.ssh/id_ed25519"
        )
    try:
        return paramiko.PKey.from_path(str(file))
    except (paramiko.PasswordRequiredException, TypeError):  # TypeError: cryptography's "password not given"
        _encrypted.add(path)
    except (paramiko.SSHException, ValueError, OSError) as exc:
        raise AuthError(
            host,
            f"ssh.key {path} is not a private key raycluster can read ({exc})",
            "point ssh.key at an OpenSSH private key",
        ) from None
    secret = passphrase()
    if secret is not None:
        try:
            return paramiko.PKey.from_path(str(file), secret.encode())  # type: ignore[arg-type]  # bytes at run time
        except (paramiko.SSHException, ValueError):
            raise AuthError(
                host,
                f"the passphrase in ${PASSPHRASE_ENV} does not open ssh.key {path}",
                f"set ${PASSPHRASE_ENV} to that key's passphrase, or load the key into ssh-agent (ssh-add {path})",
            ) from None
    if agent_has_keys():
        return None  # the agent may hold this very key, unlocked
    raise _passphrase_error(host, path)


def add_known_keys(client: paramiko.SSHClient, known_hosts_file: Path, target: str) -> None:
    """Give `client` the keys `known_hosts_file` records for `target` (`host` or `[host]:port`).

    What `client.load_host_keys(file)` would check at login, without parsing the whole file for every host:
    the file is parsed once per run (again only when it changed, e.g. after accept-new recorded a key) and
    each client gets only its own host's entries (hashed names included, as paramiko's lookup matches them).
    """
    known = _known_hosts(known_hosts_file)
    entries = known.lookup(target) if known is not None else None
    for key_type, key in (entries or {}).items():
        client.get_host_keys().add(target, key_type, key)


_known: dict[Path, tuple[tuple[int, int], paramiko.HostKeys]] = {}  # file → (its mtime and size, its keys)


def _known_hosts(path: Path) -> paramiko.HostKeys | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    stamp = (stat.st_mtime_ns, stat.st_size)
    with _lock:
        cached = _known.get(path)
        if cached is None or cached[0] != stamp:
            cached = (stamp, paramiko.HostKeys(str(path)))
            _known[path] = cached
        return cached[1]


def _passphrase_error(host: str, path: str) -> AuthError:
    return AuthError(
        host,
        f"ssh.key {path} is protected by a passphrase and no SSH agent offered a key that logs in",
        f'load it into the agent (eval "$(ssh-agent)"; ssh-add {path}), or put the passphrase in '
        f"${PASSPHRASE_ENV} (read -rs {PASSPHRASE_ENV}; export {PASSPHRASE_ENV}) — never on a command line",
    )


def connect_error(ssh: Login, exc: Exception) -> TransportError:
    """What went wrong while connecting to `ssh.host`, as one TransportError (`transient` when a retry may help)."""
    host, port = ssh.host, ssh.port
    if isinstance(exc, TransportError):
        return exc
    if isinstance(exc, paramiko.BadHostKeyException):
        return HostKeyError(
            host,
            "SSH host key has CHANGED since it was recorded (possible man-in-the-middle)",
            f"if the host was reinstalled: ssh-keygen -f {ssh.known_hosts_file} -R '{ssh.target}'",
        )
    if isinstance(exc, paramiko.PasswordRequiredException):
        return _passphrase_error(host, ssh.key_file or "(a default key in ~/.ssh)")
    if isinstance(exc, paramiko.AuthenticationException):
        return _auth_failed(ssh)
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        refused = all(getattr(e, "errno", None) == errno.ECONNREFUSED for e in exc.errors.values())
        if refused:
            return _transient(host, f"connection refused on port {port}", "start sshd on the host or fix ssh.port")
        return TransportError(
            host, f"cannot connect to port {port}: {exc.strerror or exc}", "check the address and the route to it"
        )
    if isinstance(exc, paramiko.SSHException):
        text = str(exc)
        if "known_hosts" in text:
            return HostKeyError(
                host,
                f"SSH host key is not in {ssh.known_hosts_file} (ssh.known_hosts: strict)",
                f"verify and record it: ssh-keyscan -p {port} {host} >> {ssh.known_hosts_file}, "
                "or set ssh.known_hosts: accept-new",
            )
        if "No authentication methods available" in text:
            return AuthError(
                host,
                "no SSH key to log in with (no ssh.key, no agent keys, no ~/.ssh/id_* file)",
                "set ssh.key in the inventory, or start ssh-agent and ssh-add your key",
            )
        if any(sign in text for sign in _HANDSHAKE_STALLED):
            return _transient(
                host,
                f"no SSH banner or handshake within {ssh.connect_timeout:.0f}s (host frozen or overloaded, or "
                "sshd's MaxStartups dropping new connections)",
                "check that the host answers (console, load); raise ssh.connect_timeout_s for slow hosts",
            )
        return TransportError(host, f"SSH failed: {text or type(exc).__name__}", "check sshd on the host")
    if isinstance(exc, TimeoutError):
        return TransportError(
            host,
            f"no answer on port {port} within {ssh.connect_timeout:.0f}s (host down or filtered)",
            "check the address, that the host is up, and firewalls between here and it",
        )
    if isinstance(exc, ConnectionResetError | ConnectionAbortedError | EOFError):
        return _transient(
            host,
            f"the connection was reset during login ({type(exc).__name__})",
            "check sshd on the host (MaxStartups) and re-run",
        )
    if isinstance(exc, OSError):
        return TransportError(host, f"cannot connect: {exc.strerror or exc}", "check the address and the route to it")
    return TransportError(host, f"SSH login failed: {type(exc).__name__}: {exc}", "re-run with --debug")


def _auth_failed(ssh: Login) -> AuthError:
    if ssh.key_file and ssh.key_file in _encrypted and passphrase() is None:
        return _passphrase_error(ssh.host, ssh.key_file)
    key = ssh.key_file or "agent and default keys ~/.ssh/id_*"
    return AuthError(
        ssh.host,
        f"SSH authentication failed (user={ssh.user}, key={key})",
        f"install the public key in ~{ssh.user}/.ssh/authorized_keys on {ssh.host}, or fix ssh.user/ssh.key",
    )


def _transient(host: str, message: str, hint: str) -> TransportError:
    error = TransportError(host, message, hint)
    error.transient = True
    return error
