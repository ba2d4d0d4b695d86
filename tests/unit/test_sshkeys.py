"""Which key logs in: a missing or directory key path, a passphrase-protected key, the environment variable."""

from __future__ import annotations

from pathlib import Path

import paramiko
import pytest

from raycluster_cli.errors import AuthError
from raycluster_cli.transport import sshkeys


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sshkeys, "_keys", {})
    monkeypatch.setattr(sshkeys, "_encrypted", set())
    monkeypatch.delenv(sshkeys.PASSPHRASE_ENV, raising=False)
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)


@pytest.fixture(scope="module")
def encrypted_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "id_rsa"
    paramiko.RSAKey.generate(1024).write_private_key_file(str(path), password="correct horse")
    return path


def test_a_missing_key_names_ssh_key_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(AuthError) as caught:
        sshkeys.load(str(tmp_path / "nope"), "192.0.2.1")
    assert "ssh.key" in caught.value.message and "does not exist" in caught.value.message
    assert "agent" in caught.value.hint


def test_a_directory_is_not_a_key(tmp_path: Path) -> None:
    with pytest.raises(AuthError, match="is a directory"):
        sshkeys.load(str(tmp_path), "192.0.2.1")


def test_a_passphrase_key_without_agent_says_so(encrypted_key: Path) -> None:
    with pytest.raises(AuthError) as caught:
        sshkeys.load(str(encrypted_key), "192.0.2.1")
    assert "protected by a passphrase" in caught.value.message
    assert "ssh-add" in caught.value.hint and sshkeys.PASSPHRASE_ENV in caught.value.hint
    assert "authorized_keys" not in caught.value.one_line()


def test_the_passphrase_comes_from_the_environment(encrypted_key: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sshkeys.PASSPHRASE_ENV, "correct horse")
    assert isinstance(sshkeys.load(str(encrypted_key), "192.0.2.1"), paramiko.PKey)


def test_a_wrong_passphrase_is_named(encrypted_key: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sshkeys.PASSPHRASE_ENV, "wrong")
    with pytest.raises(AuthError, match=r"does not open ssh\.key"):
        sshkeys.load(str(encrypted_key), "192.0.2.1")


def test_with_an_agent_an_encrypted_key_is_left_to_it(encrypted_key: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sshkeys, "agent_has_keys", lambda: True)
    assert sshkeys.load(str(encrypted_key), "192.0.2.1") is None


def test_refused_is_transient_auth_is_not(tmp_path: Path) -> None:
    import errno

    from raycluster_cli.transport.ssh import SSHTransport

    ssh = SSHTransport("192.0.2.1", known_hosts_file=str(tmp_path / "kh"))
    refused = paramiko.ssh_exception.NoValidConnectionsError(
        {("192.0.2.1", 22): OSError(errno.ECONNREFUSED, "refused")}
    )
    assert sshkeys.connect_error(ssh, refused).transient
    assert sshkeys.connect_error(ssh, paramiko.SSHException("Error reading SSH protocol banner")).transient
    assert sshkeys.connect_error(ssh, paramiko.SSHException("No existing session")).transient
    assert sshkeys.connect_error(ssh, ConnectionResetError()).transient
    assert not sshkeys.connect_error(ssh, paramiko.AuthenticationException("no")).transient
    assert not sshkeys.connect_error(ssh, paramiko.BadHostKeyException("h", _key(), _key())).transient
    assert not sshkeys.connect_error(ssh, TimeoutError()).transient


def _key() -> paramiko.PKey:
    return paramiko.RSAKey.generate(1024)
