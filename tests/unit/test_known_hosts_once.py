"""known_hosts is parsed once per run, and each login still checks exactly what OpenSSH would: its own
host's recorded keys (plain, `[host]:port` and hashed names), a changed file read again."""

from __future__ import annotations

from pathlib import Path

import paramiko
import pytest

from raycluster_cli.transport import knownhosts, sshkeys
from raycluster_cli.transport.ssh import SSHTransport


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(knownhosts, "GLOBAL_FILES", (tmp_path / "global_known_hosts",))
    knownhosts.forget()


def _key() -> paramiko.PKey:
    return paramiko.ECDSAKey.generate()


def _line(name: str, key: paramiko.PKey) -> str:
    return f"{name} {key.get_name()} {key.get_base64()}\n"


def _keys_for(path: Path, target: str) -> dict[str, str]:
    client = paramiko.SSHClient()
    host, _, port = target.removeprefix("[").partition("]:")
    sshkeys.add_known_keys(client, SSHTransport(host, port=int(port or 22), known_hosts_file=str(path)))
    return {kind: key.get_base64() for kind, key in (client.get_host_keys().lookup(target) or {}).items()}


def test_each_client_gets_its_own_hosts_keys_only(tmp_path: Path) -> None:
    one, two, other_port = _key(), _key(), _key()
    hashed = paramiko.HostKeys.hash_host("192.0.2.3")
    three = _key()
    known = tmp_path / "known_hosts"
    known.write_text(
        _line("192.0.2.1", one) + _line("192.0.2.2", two) + _line("[192.0.2.1]:2222", other_port) + _line(hashed, three)
    )
    assert _keys_for(known, "192.0.2.1") == {one.get_name(): one.get_base64()}
    assert _keys_for(known, "[192.0.2.1]:2222") == {other_port.get_name(): other_port.get_base64()}
    assert _keys_for(known, "192.0.2.3") == {three.get_name(): three.get_base64()}
    assert _keys_for(known, "192.0.2.9") == {}
    assert _keys_for(tmp_path / "missing", "192.0.2.1") == {}


def test_the_file_is_parsed_once_and_again_when_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    known = tmp_path / "known_hosts"
    known.write_text(_line("192.0.2.1", _key()))
    parsed: list[str] = []
    real = knownhosts._line

    def counting(raw: str, where: str) -> knownhosts.Line | None:
        if where.endswith(":1"):  # a parse of the file starts at its first line
            parsed.append(where)
        return real(raw, where)

    monkeypatch.setattr(knownhosts, "_line", counting)
    for _ in range(5):
        _keys_for(known, "192.0.2.1")
    assert len(parsed) == 1
    added = _key()
    with known.open("a") as handle:  # what accept-new does for a new host
        handle.write(_line("192.0.2.2", added))
    assert _keys_for(known, "192.0.2.2") == {added.get_name(): added.get_base64()}
    assert len(parsed) == 2
