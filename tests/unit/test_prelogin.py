"""Logins started ahead (cli/ahead.py, SSHPool.log_in_ahead): which command lines start them, that the pool
hands each host's login (or its failure, once) to the host's first use, and that the login starts before the
CLI's own imports (checked in a fresh interpreter, without timing anything)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from raycluster_cli.cli import ahead
from raycluster_cli.config import inventory
from raycluster_cli.errors import TransportError
from raycluster_cli.transport import ssh
from raycluster_cli.transport.pool import SSHPool

INVENTORY = """\
cluster: t
image: raycluster/node:0.1.0
ssh: {{key: {key}, known_hosts_file: {known}, config_file: null}}
head: {{address: 127.0.0.1}}
hosts:
  - {{address: 127.0.0.1, role: head}}
"""


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["status"], (True, None)),
        (["doctor", "-i", "a.yaml", "--json"], (True, "a.yaml")),
        (["down", "--inventory", "a.yaml"], (True, "a.yaml")),
        (["down", "--inventory=a.yaml"], (True, "a.yaml")),
        (["status", "-ia.yaml"], (True, "a.yaml")),
        (["status", "-i"], (False, None)),  # the CLI reports the missing value
        (["status", "-i", "a.yaml", "--help"], (False, None)),
        (["doctor", "--debug"], (False, None)),  # every login in --debug's log
        (["up", "-i", "a.yaml"], (True, "a.yaml")),  # its preflight logs into every host first
        (["logs", "-i", "a.yaml"], (False, None)),
        (["exec", "-i", "a.yaml", "--", "true"], (False, None)),
        ([], (False, None)),
    ],
)
def test_which_command_lines_log_in_ahead(argv: list[str], expected: tuple[bool, str | None]) -> None:
    assert ahead.inventory_argument(argv) == expected


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))  # the routes logins.py keeps


def _inventory(tmp_path: Path) -> Path:
    key = tmp_path / "id_ed25519"
    key.write_text("not read: the tests stop before the login\n")
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY.format(key=key, known=tmp_path / "known_hosts"))
    return path


def test_a_hosts_first_use_waits_for_its_login_ahead_and_sees_its_failure_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    calls: list[str] = []

    def connect(self: ssh.SSHTransport) -> None:
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            release.wait(10)
            raise TransportError(f"{self.host}: refused", "start sshd")

    monkeypatch.setattr(ssh.SSHTransport, "connect", connect)
    inv = inventory.load(_inventory(tmp_path)).inventory
    pool = SSHPool(inv)
    pool.log_in_ahead(inv.hosts)
    threading.Timer(0.2, release.set).start()
    with pytest.raises(TransportError, match="refused"):
        pool(inv.hosts[0])  # waits for the login that started ahead, and gets its failure
    assert calls == ["login-ahead"]
    pool(inv.hosts[0])  # a later use logs in afresh, as without logins ahead
    assert calls == ["login-ahead", "MainThread"]


def test_a_login_not_started_yet_is_made_by_the_hosts_first_user(tmp_path: Path) -> None:
    inv = inventory.load(_inventory(tmp_path)).inventory
    pool = SSHPool(inv)
    with pool._lock:  # the workers cannot take the host yet: its first user claims it
        pool.log_in_ahead(inv.hosts)
        pool._wait_ahead(inv.hosts[0])
    assert pool._ahead == {}


def test_take_hands_the_pool_only_to_the_same_inventory_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ssh.SSHTransport, "connect", lambda self: None)
    path = str(_inventory(tmp_path))
    ahead.start(["status", "-i", path])
    assert ahead.take("other.yaml") is None  # closed: the CLI loads its own
    ahead.start(["status", "-i", path])
    taken = ahead.take(path)
    assert taken is not None and taken[0].path == Path(path)
    assert ahead.take(path) is None  # once


def test_a_bad_inventory_starts_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: [\n")
    ahead.start(["status", "-i", str(bad)])
    assert ahead.take(str(bad)) is None


# In a fresh interpreter: the login of `raycluster status` begins before typer, the checks, the rendering or
# the CLI module are imported (the login itself is replaced: nothing leaves the machine).
SCRIPT = textwrap.dedent(
    """
    import gc, json, os, sys
    from raycluster_cli.errors import TransportError
    from raycluster_cli.transport import pool, ssh

    seen = {}
    log_in_ahead = pool.SSHPool.log_in_ahead

    def ahead(self, hosts):
        heavy = ("typer", "rich", "raycluster_cli.cli.app", "raycluster_cli.checks", "raycluster_cli.verbs.status")
        seen["loaded"] = [m for m in heavy if m in sys.modules]
        log_in_ahead(self, hosts)

    def connect(self):
        raise TransportError(f"{self.host}: refused (test)", "none")

    pool.SSHPool.log_in_ahead = ahead
    ssh.SSHTransport.connect = connect
    os.environ["RAYCLUSTER_STATE_DIR"] = sys.argv[2]
    sys.argv = ["raycluster", "status", "-i", sys.argv[1], "--json"]
    from raycluster_cli.cli import ahead, entry
    try:
        entry.main()
    except SystemExit as exc:
        seen["exit"] = exc.code
    seen["gc"] = [gc.isenabled(), gc.get_freeze_count() > 0]
    print(json.dumps(seen))
    """
)


def test_the_login_starts_before_the_clis_imports(tmp_path: Path) -> None:
    path = _inventory(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), str(tmp_path / "state")], capture_output=True, text=True, timeout=60
    )
    seen = json.loads(done.stdout.splitlines()[-1])
    document = json.loads("\n".join(done.stdout.splitlines()[:-1]))
    assert seen["loaded"] == [], f"imported before the login began: {seen['loaded']}"
    assert seen["exit"] == 1 and "refused (test)" in json.dumps(document), done.stderr
    assert seen["gc"] == [True, True]  # collector on again for the verb; the imports' objects frozen
