"""known_hosts as OpenSSH reads it (issue 34, item 2): a `@cert-authority` or `@revoked` line, or a line
paramiko cannot parse, beside the right keys, no longer stops every login with a cryptic InvalidHostKey;
`@revoked` keys are refused naming the file and line; a host known only through a `@cert-authority` line is
refused saying so; /etc/ssh/ssh_known_hosts is read too. Each login is real: paramiko's SSH server on one end
of a socket pair."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from raycluster_cli.errors import HostKeyError
from raycluster_cli.transport import knownhosts
from raycluster_cli.transport.ssh import SSHTransport
from tests.unit.sshpair import Pair

# A real CA line as `ssh-keygen -s` users write it (the key is a throwaway ed25519 public key).
CA_LINE = (
    "@cert-authority *.example.com ssh-ed25519 "
    "AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl ca@example.com\n"
)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.setattr(knownhosts, "GLOBAL_FILES", (tmp_path / "etc_ssh_known_hosts",))
    knownhosts.forget()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    served = Pair(tmp_path)
    yield served
    served.close()


def _login(pair: Pair, known: Path, policy: str = "strict") -> SSHTransport:
    ssh = SSHTransport(
        "192.0.2.1", key_file=str(pair.client_key_file), known_hosts=policy, known_hosts_file=str(known),
        connect_timeout=5, retries=0, sock=pair.sock, keepalive_s=0,
    )  # fmt: skip
    ssh.connect()
    return ssh


def test_a_cert_authority_line_beside_the_right_key_logs_in(pair: Pair, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text(CA_LINE + pair.known_line())
    _login(pair, known).close()


def test_a_line_paramiko_cannot_read_is_skipped_as_openssh_does(pair: Pair, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text("192.0.2.9 ssh-ed25519 not*base64\n@bogus x y z\n" + pair.known_line())
    _login(pair, known).close()


def test_a_revoked_key_is_refused_naming_file_and_line(pair: Pair, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text(pair.known_line() + "# the old key leaked\n@revoked * " + pair.known_line().split(" ", 1)[1])
    with pytest.raises(HostKeyError) as info:
        _login(pair, known)
    assert f"{known}:3" in info.value.message and "@revoked" in info.value.message
    assert info.value.host == "192.0.2.1"
    with pytest.raises(HostKeyError):  # accept-new never records a revoked key
        _login(pair, known, "accept-new")


def test_a_host_known_only_through_a_cert_authority_is_refused_saying_so(pair: Pair, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.write_text("# fleet CA\n" + CA_LINE.replace("*.example.com", "192.0.2.*"))
    with pytest.raises(HostKeyError) as info:
        _login(pair, known)
    message = info.value.message
    assert f"{known}:2" in message and "@cert-authority" in message and "not supported" in message
    assert "ssh-keyscan" in info.value.hint


def test_the_global_known_hosts_file_is_read(pair: Pair, tmp_path: Path) -> None:
    knownhosts.GLOBAL_FILES[0].write_text(pair.known_line())
    _login(pair, tmp_path / "no_user_file").close()


def test_a_known_hosts_file_that_cannot_be_read_is_named(pair: Pair, tmp_path: Path) -> None:
    known = tmp_path / "known_hosts"
    known.mkdir()
    with pytest.raises(HostKeyError) as info:
        _login(pair, known)
    assert str(known) in info.value.message


def test_patterns_negation_and_hashed_names_match_as_openssh(tmp_path: Path) -> None:
    key = paramiko.ECDSAKey.generate()
    body = f"{key.get_name()} {key.get_base64()}\n"
    known = tmp_path / "known_hosts"
    known.write_text(
        f"10.0.0.*,!10.0.0.7 {body}[10.1.0.1]:2222 {body}{paramiko.HostKeys.hash_host('10.2.0.1')} {body}"
        f"10.3.0.? {body}"
    )

    def found(target: str) -> bool:
        return bool(knownhosts.read([known]).for_target(target).keys)

    assert found("10.0.0.5") and not found("10.0.0.7")
    assert found("[10.1.0.1]:2222") and not found("10.1.0.1")
    assert found("10.2.0.1") and found("10.3.0.4") and not found("10.3.0.40")
