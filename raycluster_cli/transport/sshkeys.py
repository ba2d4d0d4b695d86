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
from raycluster_cli.transport import knownhosts


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

    @property
    def accept_new(self) -> bool: ...  # ssh.known_hosts: accept-new


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


def add_known_keys(client: paramiko.SSHClient, ssh: Login) -> None:
    """Give `client` the keys known_hosts records for `ssh.target` (the user's file, then the global ones, as
    OpenSSH reads them; see knownhosts.py) and the policy for a key it does not know: `@revoked` refused,
    `@cert-authority` named, strict refused, accept-new recorded. A file that cannot be read is a HostKeyError."""
    files = [ssh.known_hosts_file, *knownhosts.GLOBAL_FILES]
    try:
        known = knownhosts.read(files).for_target(ssh.target)
    except OSError as exc:
        raise HostKeyError(
            ssh.host,
            f"cannot read the known_hosts file {exc.filename or ssh.known_hosts_file}: {exc.strerror or exc}",
            "fix ssh.known_hosts_file (a readable file; missing is fine), or its permissions",
        ) from None
    for key in known.keys:
        client.get_host_keys().add(ssh.target, key.get_name(), key)
    client.set_missing_host_key_policy(_UnknownKey(ssh, known))


class _UnknownKey(paramiko.MissingHostKeyPolicy):
    """The host offered a key known_hosts does not give it (paramiko refuses a *different* key itself)."""

    def __init__(self, ssh: Login, known: knownhosts.Matches) -> None:
        self.ssh, self.known = ssh, known

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        ssh, file = self.ssh, self.ssh.known_hosts_file
        revoked = self.known.revoked_at(key)
        if revoked is not None:
            raise HostKeyError(
                ssh.host,
                f"SSH host key {knownhosts.fingerprint(key)} is marked @revoked at {revoked}",
                "the host's key was revoked: give the host a new key and record it, or remove that line if it is wrong",
            )
        if ssh.accept_new:
            with _lock:
                file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                with file.open("a") as handle:
                    handle.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            client.get_host_keys().add(hostname, key.get_name(), key)
            return
        keyscan = f"ssh-keyscan -p {ssh.port} {ssh.host} >> {file}"
        if self.known.authorities:
            raise HostKeyError(
                ssh.host,
                f"{self.known.authorities[0]}: @cert-authority (CA-signed host keys) is not supported by raycluster, "
                f"and no plain key for {ssh.target} is recorded",
                f"verify and record the host's own key: {keyscan}, or set ssh.known_hosts: accept-new",
            )
        raise HostKeyError(
            ssh.host,
            f"SSH host key is not in {file} (ssh.known_hosts: strict)",
            f"verify and record it: {keyscan}, or set ssh.known_hosts: accept-new",
        )


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
        return _ssh_protocol_error(ssh, exc)
    if isinstance(exc, TimeoutError):
        error = TransportError(
            host,
            f"no answer on port {port} within {ssh.connect_timeout:.0f}s (host down or filtered)",
            "check the address, that the host is up, and firewalls between here and it",
        )
        error.silent = True
        return error
    if isinstance(exc, ConnectionResetError | ConnectionAbortedError | EOFError):
        return _transient(
            host,
            f"the connection was reset during login ({type(exc).__name__})",
            "check sshd on the host (MaxStartups) and re-run",
        )
    if isinstance(exc, OSError):
        return TransportError(host, f"cannot connect: {exc.strerror or exc}", "check the address and the route to it")
    return TransportError(host, f"SSH login failed: {type(exc).__name__}: {exc}", "re-run with --debug")


def _ssh_protocol_error(ssh: Login, exc: paramiko.SSHException) -> TransportError:
    """An SSH-level failure while connecting: the host key unknown, no key to log in with, a stalled handshake."""
    host, port = ssh.host, ssh.port
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
        error = _transient(
            host,
            f"no SSH banner or handshake within {ssh.connect_timeout:.0f}s (host frozen or overloaded, or "
            "sshd's MaxStartups dropping new connections)",
            "check that the host answers (console, load); raise ssh.connect_timeout_s for slow hosts",
        )
        error.silent = True
        return error
    return TransportError(host, f"SSH failed: {text or type(exc).__name__}", "check sshd on the host")


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
