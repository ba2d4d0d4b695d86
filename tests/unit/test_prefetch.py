"""Read-only commands started ahead (prefetch.py, SSHTransport.run, logins.py): only commands declared
read-only are kept, as recipes the code makes the command from again (never a command read from disk); the
one started after the login answers the CLI's identical call (a facts batch with the caller's marker in place
of its own, timed by when it really ran); anything else runs as before. No command leaves the machine here:
the transport's channel work (`_command`) and its login are replaced (test_prefetch_recipes.py logs in for
real)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli.cli import ahead
from raycluster_cli.errors import HostStoppedAnswering
from raycluster_cli.host import facts
from raycluster_cli.transport import CommandResult, logins, prefetch, ssh
from raycluster_cli.transport.batch import batch_script, fake_batch_output

INVENTORY = """\
cluster: t
image: raycluster/node:0.1.0
ssh: {{key: {key}, known_hosts_file: {known}, config_file: null}}
head: {{address: 192.0.2.10}}
hosts:
  - {{address: 192.0.2.10, role: head}}
"""


class Host:
    """SSHTransport's login and channel work replaced: every command that would reach the host is recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, answer: Any = None) -> None:
        self.ran: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        ran, lock = self.ran, self.lock
        answer = answer or (lambda command: CommandResult(0, f"out of {command[:12]}", ""))

        def connect(transport: ssh.SSHTransport) -> None:
            transport._client = object()  # type: ignore[assignment]

        def command(transport: ssh.SSHTransport, command: str, **_: Any) -> CommandResult:
            with lock:
                ran.append((threading.current_thread().name, command))
            return answer(command)  # type: ignore[no-any-return]

        monkeypatch.setattr(ssh.SSHTransport, "connect", connect)
        monkeypatch.setattr(ssh.SSHTransport, "_command", command)
        monkeypatch.setattr(ssh.SSHTransport, "close", lambda transport: None)


@prefetch.builder("test-look")
def _look(inventory: Any, host: Any, args: dict[str, Any]) -> tuple[str, float]:
    """A read-only command made from the host and a number (what a kept recipe holds)."""
    return f"look {host.address} {int(args['n'])}", 60


def _transport() -> ssh.SSHTransport:
    return ssh.SSHTransport("192.0.2.10", key_file=None, known_hosts_file="/nonexistent")


def test_only_a_command_declared_read_only_is_recorded_and_only_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    Host(monkeypatch)
    transport = _transport()
    transport.run("docker rm -f x", timeout=10)
    assert transport.first_read_only is None
    with prefetch.read_only("test-look", {"n": 1}):
        transport.run("look 192.0.2.10 1", timeout=60)
        with prefetch.read_only("test-look", {"n": 2}):
            transport.run("look 192.0.2.10 2", timeout=60)
    assert transport.first_read_only == {"kind": "test-look", "args": {"n": 1}}  # the recipe, not the command
    assert not prefetch.declared_read_only()  # the block ended
    with pytest.raises(KeyError, match="no read-only command builder 'nobody'"), prefetch.read_only("nobody"):
        pass


def test_the_command_started_ahead_answers_the_same_call_once(monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host(monkeypatch)
    transport = _transport()
    pending = transport.expect("docker ps", 60)
    transport.start_ahead("docker ps", 60, pending)
    assert transport.run("docker ps", timeout=30).stdout == "out of docker ps"  # another deadline: runs again
    result = transport.run("docker ps", timeout=60)
    assert result.stdout == "out of docker ps" and result.window is not None
    assert len(host.ran) == 2  # ahead, and the call with another deadline; the matching call ran nothing
    transport.run("docker ps", timeout=60)
    assert len(host.ran) == 3  # once only


def test_a_call_waits_for_the_command_still_running_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def slow(command: str) -> CommandResult:
        release.wait(10)
        return CommandResult(0, "late", "")

    host = Host(monkeypatch, slow)
    transport = _transport()
    pending = transport.expect("docker ps", 60)
    threading.Thread(target=transport.start_ahead, args=("docker ps", 60, pending), name="ahead").start()
    threading.Timer(0.1, release.set).start()
    assert transport.run("docker ps", timeout=60).stdout == "late"
    assert [name for name, _ in host.ran] == ["ahead"]


def test_a_call_that_comes_first_runs_the_command_itself_and_it_is_never_started_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = Host(monkeypatch)
    transport = _transport()
    pending = transport.expect("docker ps", 60)
    assert transport.run("docker ps", timeout=60).stdout == "out of docker ps"  # nothing waits for the thread
    transport.start_ahead("docker ps", 60, pending)  # the thread, late
    assert [name for name, _ in host.ran] == ["MainThread"]


def test_a_command_that_failed_ahead_runs_again_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def flaky(command: str) -> CommandResult:
        calls.append(command)
        if len(calls) == 1:
            raise OSError("connection dropped")
        return CommandResult(0, "fine", "")

    Host(monkeypatch, flaky)
    transport = _transport()
    pending = transport.expect("docker ps", 60)
    transport.start_ahead("docker ps", 60, pending)
    assert pending.done.is_set() and pending.result is None
    assert transport.run("docker ps", timeout=60).stdout == "fine"
    assert len(calls) == 2


def test_a_host_that_stopped_answering_under_the_command_started_ahead_fails_the_call_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The keepalive dropped the connection under the command run ahead (a frozen host): the CLI's call gets
    that error, as it would have running the command itself. Running it again first waited out a login to
    the frozen host, and the verb then named the login ("no SSH banner"), not the freeze (the lab's
    run-ahead fault test)."""
    calls: list[str] = []

    def frozen(command: str) -> CommandResult:
        calls.append(command)
        raise HostStoppedAnswering("192.0.2.10", "the host stopped answering (nothing received for 6s) during x")

    Host(monkeypatch, frozen)
    transport = _transport()
    pending = transport.expect("docker ps", 60)
    transport.start_ahead("docker ps", 60, pending)
    with pytest.raises(HostStoppedAnswering, match="stopped answering"):
        transport.run("docker ps", timeout=60)
    assert len(calls) == 1  # not run again


def test_a_facts_batch_is_kept_without_its_marker_and_answers_with_the_callers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    host = Host(monkeypatch, lambda script: fake_batch_output(script, lambda c: CommandResult(0, f"{c}!", "")))
    first = batch_script(prefetch.new_marker(), ["hostname", "nproc"])
    blanked, marker = prefetch.shape(first)
    assert marker is not None and marker not in blanked and prefetch.shape(blanked) == (blanked, None)
    transport = _transport()
    pending = transport.expect(blanked, 120)
    transport.start_ahead(blanked, 120, pending)
    mine = prefetch.new_marker()
    result = transport.run(batch_script(mine, ["hostname", "nproc"]), timeout=120)
    assert len(host.ran) == 1 and mine not in host.ran[0][1]  # ran ahead with a marker of its own
    assert pending.marker is not None and pending.marker not in result.stdout
    assert result.stdout.count(mine) == 7  # 2 x (out, err, rc) and the time line: parseable with the caller's
    assert batch_script(mine, ["hostname"]) != batch_script(prefetch.new_marker(), ["hostname"])


def test_a_timed_fact_answered_ahead_is_timed_by_when_it_really_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = facts.raw("clock", lambda ctx: "date +%s.%N", timed=True)

    class Ahead:
        host = "192.0.2.10"

        def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = None) -> CommandResult:
            out = fake_batch_output(command, lambda c: CommandResult(0, "1700000000.5", ""))
            return CommandResult(out.rc, out.stdout, out.stderr, window=(1700000000.0, 1700000001.0))

    found = facts.gather_host(Ahead(), None, [clock])  # type: ignore[arg-type]
    assert found["clock"].stdout.startswith("operator 1700000000.000000 1700000001.000000\n1700000000.5")


# -- with logins.py: the second run of the same command line starts the first command after the login --------


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)


def _inventory(tmp_path: Path) -> Path:
    key = tmp_path / "id_ed25519"
    key.write_text("not read: the login is replaced\n")
    path = tmp_path / "inventory.yaml"
    path.write_text(INVENTORY.format(key=key, known=tmp_path / "known_hosts"))
    return path


def _verb(path: Path, argv: list[str], n: int | None) -> None:
    """One command line as the CLI runs it: logins ahead, its first command (declared read-only), its end."""
    ahead.start(argv)
    taken = ahead.take(str(path))
    assert taken is not None
    inventory, pool = taken
    transport = pool(inventory.inventory.hosts[0])
    for pending in list(transport._ahead.values()):  # let the thread started after the login claim it first
        for _ in range(200):
            if pending._claimed:
                break
            threading.Event().wait(0.01)
    if n is not None:
        with prefetch.read_only("test-look", {"n": n}):
            transport.run(_look(inventory.inventory, inventory.inventory.hosts[0], {"n": n})[0], timeout=60)
    pool.close()
    ahead.remember()


def test_the_next_run_of_the_same_command_line_starts_its_first_command_after_the_login(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = Host(monkeypatch)
    path = _inventory(tmp_path)
    status = ["status", "-i", str(path), "--json"]
    _verb(path, status, 1)
    assert [name for name, _ in host.ran] == ["MainThread"]
    kept = json.loads(logins.cache_file(path.resolve()).read_text())["first"]
    assert kept == {json.dumps(status): {"192.0.2.10": {"kind": "test-look", "args": {"n": 1}}}}

    host.ran.clear()
    _verb(path, status, 1)
    assert host.ran == [("read-ahead", "look 192.0.2.10 1")]  # ran after the login; the CLI's call waited for it

    host.ran.clear()
    _verb(path, ["status", "-i", str(path)], 1)  # another command line: nothing ahead
    assert [name for name, _ in host.ran] == ["MainThread"]

    host.ran.clear()
    _verb(path, status, None)  # this time the verb asked nothing read-only: forgotten for the next run
    assert [name for name, _ in host.ran] == ["read-ahead"]  # (this run's was still started ahead)
    assert json.dumps(status) not in json.loads(logins.cache_file(path.resolve()).read_text())["first"]


def test_an_edited_inventory_starts_no_command_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host(monkeypatch)
    path = _inventory(tmp_path)
    status = ["status", "-i", str(path)]
    _verb(path, status, 1)
    path.write_text(path.read_text() + "# edited\n")
    host.ran.clear()
    _verb(path, status, 1)
    assert [name for name, _ in host.ran] == ["MainThread"]


def test_many_hosts_through_a_narrow_gate_all_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More hosts than login threads, the pool adopting them while the threads still work through the queue:
    every host's first call returns (a host whose login thread never got to it runs the command itself)."""
    host = Host(monkeypatch)
    slow = ssh.SSHTransport.connect

    def connect(transport: ssh.SSHTransport) -> None:
        threading.Event().wait(0.02)
        slow(transport)

    monkeypatch.setattr(ssh.SSHTransport, "connect", connect)
    hosts = "".join(f"  - {{address: 192.0.2.{10 + i}, role: {'head' if i == 0 else 'worker'}}}\n" for i in range(10))
    path = _inventory(tmp_path)
    path.write_text(path.read_text().split("hosts:")[0] + "hosts:\n" + hosts + "ssh_extra: null\n")
    path.write_text(
        path.read_text()
        .replace("ssh_extra: null\n", "")
        .replace("config_file: null", "config_file: null, max_parallel_logins: 2")
    )
    argv = ["status", "-i", str(path)]

    def verb() -> list[str]:
        ahead.start(argv)
        taken = ahead.take(str(path))
        assert taken is not None
        inventory, pool = taken
        outs = []
        for h in inventory.inventory.hosts:
            with prefetch.read_only("test-look", {"n": 7}):
                outs.append(pool(h).run(_look(None, h, {"n": 7})[0], timeout=60).stdout)
        pool.close()
        ahead.remember()
        return outs

    assert len(verb()) == 10
    host.ran.clear()
    done: list[list[str]] = []
    worker = threading.Thread(target=lambda: done.append(verb()))
    worker.start()
    worker.join(30)
    assert done and len(done[0]) == 10, "a host's first call never returned"
    assert sorted(command for _, command in host.ran) == sorted(f"look 192.0.2.{10 + i} 7" for i in range(10))
