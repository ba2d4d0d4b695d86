"""Logins started from the last run's routes (logins.py): kept per inventory, started only while their stamp
holds, adopted by the pool only where the validated inventory gives the very same parameters, the rest closed;
and in a fresh interpreter, started before pydantic is imported. No login leaves the machine: connect is
replaced."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli.cli import ahead
from raycluster_cli.transport import logins, ssh

INVENTORY = """\
cluster: t
image: raycluster/node:0.1.0
ssh: {{key: {key}, known_hosts_file: {known}, config_file: {config}{user}}}
head: {{address: 192.0.2.10}}
hosts:
  - {{address: 192.0.2.10, role: head}}
  - {{address: 192.0.2.11, role: worker}}
"""


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)


def _inventory(tmp_path: Path, user: str | None = None, config: str = "null") -> Path:
    key = tmp_path / "id_ed25519"
    key.write_text("not read: connect is replaced\n")
    path = tmp_path / "inventory.yaml"
    path.write_text(
        INVENTORY.format(key=key, known=tmp_path / "known_hosts", config=config, user=f", user: {user}" if user else "")
    )
    return path


class Logins:
    """SSHTransport.connect replaced: records each login's thread, user and host; closes counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.closed: list[str] = []
        self.lock = threading.Lock()
        calls, closed, lock = self.calls, self.closed, self.lock

        def connect(transport: ssh.SSHTransport) -> None:
            if transport._client is not None:
                return  # as the real one: logged in once, later calls reuse the connection
            with lock:
                calls.append((threading.current_thread().name, transport.user, transport.host))
            transport._client = object()  # type: ignore[assignment]  # "connected": later calls return at once

        def close(transport: ssh.SSHTransport) -> None:
            with lock:
                closed.append(transport.host)

        monkeypatch.setattr(ssh.SSHTransport, "connect", connect)
        monkeypatch.setattr(ssh.SSHTransport, "close", close)

    def threads(self) -> list[str]:
        with self.lock:
            return sorted(name for name, _, _ in self.calls)


def _run(path: Path) -> Any:
    """One command line's logins ahead, as `raycluster status -i PATH` starts them; the pool it hands on."""
    ahead.start(["status", "-i", str(path)])
    taken = ahead.take(str(path))
    assert taken is not None
    pool = taken[1]
    # Until a login thread has taken each host: a host's first use that comes sooner logs in itself (the
    # pool's race, right as it is), which on a loaded machine made the thread names below a matter of timing.
    with pool._lock:
        aheads = list(pool._ahead.values())
    deadline = time.monotonic() + 30
    while not all(ahead.started for ahead in aheads) and time.monotonic() < deadline:
        time.sleep(0.01)
    for host in taken[0].inventory.hosts:
        pool._wait_ahead(host)
    ahead.remember()  # as the CLI's end does
    return pool


def test_the_first_run_keeps_its_routes_and_the_next_starts_them_before_the_inventory_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = Logins(monkeypatch)
    path = _inventory(tmp_path)
    _run(path)
    assert seen.threads() == ["login-ahead", "login-ahead"]  # no routes kept yet: logged in after the read
    kept = json.loads(logins.cache_file(path.resolve()).read_text())
    assert sorted(kept["logins"]) == ["192.0.2.10", "192.0.2.11"]
    assert kept["logins"]["192.0.2.11"]["user"] == "root" and "token" not in json.dumps(kept)
    assert oct(logins.cache_file(path.resolve()).stat().st_mode & 0o777) == "0o600"

    seen.calls.clear()
    pool = _run(path)
    assert seen.threads() == ["login-cached", "login-cached"]  # adopted: the pool logged in to nothing itself
    assert sorted(pool._open) == ["192.0.2.10", "192.0.2.11"] and seen.closed == []
    pool(prelogin_host(path, 1))  # the host's first use: connected already, no further login
    assert len(seen.calls) == 2


def prelogin_host(path: Path, index: int) -> Any:
    from raycluster_cli.config import inventory

    return inventory.load(path).inventory.hosts[index]


def test_an_edited_inventory_starts_nothing_from_the_old_routes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = Logins(monkeypatch)
    path = _inventory(tmp_path)
    _run(path)
    path = _inventory(tmp_path, user="ops")  # another login user: the stamp no longer holds
    seen.calls.clear()
    quick, document = logins.start(str(path))
    assert quick is None and document is not None
    _run(path)
    assert seen.threads() == ["login-ahead", "login-ahead"]
    assert {user for _, user, _ in seen.calls} == {"ops"}
    assert json.loads(logins.cache_file(path.resolve()).read_text())["logins"]["192.0.2.10"]["user"] == "ops"


def test_a_changed_ssh_config_or_working_folder_breaks_the_stamp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    Logins(monkeypatch)
    config = tmp_path / "ssh_config"
    config.write_text("Host 192.0.2.11\n  User alice\n")
    path = _inventory(tmp_path, config=str(config))
    _run(path)
    assert json.loads(logins.cache_file(path.resolve()).read_text())["logins"]["192.0.2.11"]["user"] == "alice"
    config.write_text("Host 192.0.2.11\n  User bob\n")
    assert logins.start(str(path))[0] is None
    _run(path)  # kept again, with bob
    quick, _ = logins.start(str(path))
    assert quick is not None
    quick.discard()
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)  # a relative key path would name another file from here
    assert logins.start(str(path))[0] is None


def test_a_login_the_validated_inventory_does_not_ask_for_is_closed_unused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = Logins(monkeypatch)
    path = _inventory(tmp_path)
    _run(path)
    cache = logins.cache_file(path.resolve())
    kept = json.loads(cache.read_text())
    kept["logins"]["192.0.2.11"]["user"] = "mallory"  # the stamp still holds; the parameters do not
    cache.write_text(json.dumps(kept))
    seen.calls.clear()
    pool = _run(path)
    deadline = threading.Event()
    for _ in range(100):  # the unused login is closed once it ends (in its own thread)
        if seen.closed:
            break
        deadline.wait(0.05)
    assert seen.closed == ["192.0.2.11"]
    users = {(name, user, host) for name, user, host in seen.calls}
    assert ("login-cached", "root", "192.0.2.10") in users
    assert ("login-ahead", "root", "192.0.2.11") in users  # the pool logged in to it with the right user
    assert pool._open["192.0.2.11"].user == "root"
    assert json.loads(cache.read_text())["logins"]["192.0.2.11"]["user"] == "root"  # rewritten


def test_a_different_login_gate_width_is_not_adopted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = Logins(monkeypatch)
    path = _inventory(tmp_path)
    _run(path)
    cache = logins.cache_file(path.resolve())
    kept = json.loads(cache.read_text())
    kept["parallel"] = 1
    cache.write_text(json.dumps(kept))
    seen.calls.clear()
    _run(path)
    assert "login-ahead" in seen.threads()


@pytest.mark.parametrize("content", ["{", "[]", '{"stamp": 1}', '{"stamp": {"ssh_config_file": null}}'])
def test_a_cache_this_version_did_not_write_is_ignored_and_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str
) -> None:
    seen = Logins(monkeypatch)
    path = _inventory(tmp_path)
    cache = logins.cache_file(path.resolve())
    cache.parent.mkdir(parents=True)
    cache.write_text(content)
    _run(path)
    assert seen.threads() == ["login-ahead", "login-ahead"]
    assert sorted(json.loads(cache.read_text())["logins"]) == ["192.0.2.10", "192.0.2.11"]


def test_hosts_behind_a_jump_host_are_never_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Logins(monkeypatch)
    path = _inventory(tmp_path)
    path.write_text(path.read_text().replace("config_file: null", "config_file: null, proxy_jump: admin@192.0.2.1"))
    ahead.start(["status", "-i", str(path)])
    taken = ahead.take(str(path))
    assert taken is not None
    taken[1].close()
    assert not logins.cache_file(path.resolve()).exists()


# In a fresh interpreter, with the routes kept: the logins start before pydantic, the inventory's models, typer
# or the CLI are imported (the login itself is replaced: nothing leaves the machine).
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from raycluster_cli.transport import logins
    from raycluster_cli.transport import ssh

    seen = {}
    start = logins.QuickLogins.start

    def started(self):
        heavy = ("pydantic", "yaml", "raycluster_cli.config.inventory", "typer", "raycluster_cli.cli.app")
        seen["loaded"] = [m for m in heavy if m in sys.modules]
        start(self)

    def connect(self):
        self._client = object()

    logins.QuickLogins.start = started
    ssh.SSHTransport.connect = connect
    ssh.SSHTransport.close = lambda self: None
    from raycluster_cli.cli import ahead, entry
    ahead.start(["status", "-i", sys.argv[1]])
    print(json.dumps(seen))
    """
)


def test_kept_logins_start_before_pydantic_is_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    Logins(monkeypatch)
    path = _inventory(tmp_path)
    _run(path)  # keeps the routes (in this process)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=60)
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"loaded": []}, done.stderr
