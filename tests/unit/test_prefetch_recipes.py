"""The command started ahead after a login is made by the code, never read from disk (issue 34, item 10).

The logins cache (a JSON file in the state folder) used to hold, per command line, the shell string the last
run began with on each host, and the next run sent that string to every host right after the login: anyone who
could write the file ran commands on every host. Now it holds a recipe (a builder's name and its arguments)
and the code makes the command again from the validated inventory. Real logins: paramiko's SSH server on a
socket pair (sshpair.py) sees every command that reaches the "host"."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import paramiko
import pytest

from raycluster_cli.cli import ahead
from raycluster_cli.transport import logins, ssh
from raycluster_cli.verbs.status import status
from tests.unit.sshpair import Pair

INVENTORY = """\
cluster: t
image: raycluster/node:0.1.0
ssh: {{key: {key}, known_hosts_file: {known}, config_file: null}}
head: {{address: 192.0.2.10}}
hosts:
  - {{address: 192.0.2.10, role: head}}
"""


class Host:
    """A real SSH server for 192.0.2.10 that answers every command with nothing and records it."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.commands: list[str] = []
        self.lock = threading.Lock()
        self.pair = Pair(tmp, on_exec=self._exec)
        (tmp / "known_hosts").write_text(self.pair.known_line("192.0.2.10"))
        init = ssh.SSHTransport.__init__

        def with_pair(transport: ssh.SSHTransport, *args: Any, **kwargs: Any) -> None:
            kwargs["sock"] = kwargs.get("sock") or self.pair.sock
            init(transport, *args, **kwargs)

        monkeypatch.setattr(ssh.SSHTransport, "__init__", with_pair)

    def _exec(self, channel: paramiko.Channel, command: str) -> None:
        with self.lock:
            self.commands.append(command)
        while channel.recv(1024):  # until the client's end of input, as sshd's command would read it
            pass
        channel.send_exit_status(0)

    def ran(self, text: str) -> int:
        with self.lock:
            return sum(text in command for command in self.commands)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Host:
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    made = Host(tmp_path, monkeypatch)
    yield made
    made.pair.close()


def _inventory(tmp_path: Path, host: Host) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY.format(key=host.pair.client_key_file, known=tmp_path / "known_hosts"))
    return path


def _status(path: Path) -> str:
    """One `status -i PATH` as the CLI runs it: logins (and the command) ahead, the verb, its end."""
    ahead.start(["status", "-i", str(path)])
    taken = ahead.take(str(path))
    assert taken is not None
    loaded, pool = taken
    try:
        result = status(loaded.inventory, pool)
    finally:
        pool.close()
    ahead.remember()
    return result.hosts[0].container


def _plant(path: Path, first: Any) -> None:
    """Write `first` as this command line's first command on 192.0.2.10 into the logins cache, stamp intact."""
    cache = logins.cache_file(path.resolve())
    document = json.loads(cache.read_text())
    document["first"][json.dumps(["status", "-i", str(path)])] = {"192.0.2.10": first}
    cache.write_text(json.dumps(document))


def test_the_status_look_is_made_again_and_answers_the_next_run(tmp_path: Path, host: Host) -> None:
    path = _inventory(tmp_path, host)
    assert _status(path) == "missing"
    assert host.ran("docker inspect") == 1
    kept = json.loads(logins.cache_file(path.resolve()).read_text())["first"]
    assert kept == {json.dumps(["status", "-i", str(path)]): {"192.0.2.10": {"kind": "status", "args": {}}}}
    assert _status(path) == "missing"
    assert host.ran("docker inspect") == 2  # once per run: the look started after the login answered the verb


@pytest.mark.parametrize(
    "planted",
    [
        ["touch /tmp/raycluster-planted", 60],  # what the cache used to hold: a shell string and its timeout
        {"kind": "facts", "args": {"facts": ["touch /tmp/raycluster-planted"], "deadline_s": 60}},
        {"kind": "touch /tmp/raycluster-planted", "args": {}},
        {"kind": "status", "args": {}, "command": "touch /tmp/raycluster-planted"},
    ],
)
def test_a_command_written_into_the_cache_never_reaches_the_host(tmp_path: Path, host: Host, planted: Any) -> None:
    path = _inventory(tmp_path, host)
    _status(path)
    _plant(path, planted)
    assert _status(path) == "missing"
    assert host.ran("raycluster-planted") == 0
    assert host.ran("docker inspect") == 2  # the verb's own look ran, as it would have without a cache


def test_a_facts_recipe_is_made_again_only_from_facts_the_code_defines(tmp_path: Path, host: Host) -> None:
    from raycluster_cli.checks import catalog  # noqa: F401 (defines doctor's facts)
    from raycluster_cli.config.inventory import load
    from raycluster_cli.host import facts
    from raycluster_cli.transport import prefetch

    inventory = load(str(_inventory(tmp_path, host))).inventory
    head = inventory.hosts[0]
    names = [name for name in facts.KNOWN if facts.KNOWN[name].command is not None][:3]
    built = prefetch.build({"kind": "facts", "args": {"facts": names, "deadline_s": 120}}, inventory, head)
    assert built is not None and built[1] == 150
    ctx = facts.HostContext(inventory, head)
    for name in names:
        assert facts.KNOWN[name].command(ctx) in built[0]  # type: ignore[misc]
    assert prefetch.shape(built[0]) == (built[0], None)  # handed on with its marker blanked
    for bad in (
        {"facts": [*names, "rm -rf ~"], "deadline_s": 120},
        {"facts": names, "deadline_s": float("inf")},
        {"facts": names, "deadline_s": "x"},
        {"facts": "hostname", "deadline_s": 120},
        {"facts": [], "deadline_s": 120},
        {"facts": names},
    ):
        assert prefetch.build({"kind": "facts", "args": bad}, inventory, head) is None
