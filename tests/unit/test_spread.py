"""Image distribution with fake hosts: one seed from the operator, peers after, fallback to the operator."""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from raycluster_cli.config.inventory import Inventory, parse
from raycluster_cli.delivery import peer_copy as peers
from raycluster_cli.delivery import receive
from raycluster_cli.delivery import schedule as spread
from raycluster_cli.delivery.deliver import choose_codec, decompressor, distribute, image_job
from raycluster_cli.delivery.relay import TOOLS_COMMAND
from raycluster_cli.delivery.schedule import ImageTransfer
from raycluster_cli.errors import OperationError
from raycluster_cli.progress import TransferProgress
from raycluster_cli.transport import CommandResult
from raycluster_cli.transport.fake import FakeTransport

A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64


def _fleet(count: int) -> Inventory:
    hosts = "\n".join(f"  - {{address: 192.0.2.{10 + i}, role: {'worker' if i else 'head'}}}" for i in range(count))
    return parse(f"cluster: t\nimage: img:1\nhead:\n  address: 192.0.2.10\nhosts:\n{hosts}\n")


class Host(FakeTransport):
    """A fake host that also remembers what came on stdin (the secrets)."""

    def __init__(self, host: str, table: dict[str, CommandResult | str]) -> None:
        super().__init__(host, table)
        self.stdin: list[bytes] = []
        self.lock = threading.Lock()

    def run(self, command: str, *, stdin: bytes | None = None, **options: Any) -> CommandResult:
        with self.lock:
            if stdin is not None:
                self.stdin.append(stdin)
            return super().run(command, stdin=stdin, **options)


TOOLS = "zstd\nbash\ntimeout\nsha256sum\n"
LISTENER = "compare_digest"  # in the listener's command only (the receive commands name python3 too: the hash)


def _table(loaded: str = A, tools: str = TOOLS) -> dict[str, CommandResult | str]:
    table: dict[str, CommandResult | str] = {re.escape(TOOLS_COMMAND): tools}
    table.update({LISTENER: "123", "/dev/tcp/": f"Loaded image: img:1\n{loaded}\n"})
    table.update({"docker load": f"Loaded image: img:1\n{loaded}\n", "stat -c": "0", "rm -f": ""})
    return table


def _host(address: str, loaded: str = A, tools: str = TOOLS, **extra: CommandResult | str) -> Host:
    return Host(address, {**_table(loaded, tools), **extra})


def _plan(inv: Inventory) -> list[ImageTransfer]:
    return [ImageTransfer(str(h.address), "missing", "stream") for h in inv.hosts]


@pytest.fixture
def archive(tmp_path: Path) -> Path:
    path = tmp_path / f"{A[7:19]}.tar.zst"
    path.write_bytes(b"z" * 1000)
    return path


def test_the_operator_seeds_one_host_and_the_hosts_serve_the_rest(archive: Path) -> None:
    inv = _fleet(8)
    hosts = {str(h.address): _host(str(h.address)) for h in inv.hosts}
    events: list[object] = []
    done = distribute(inv, lambda h: hosts[str(h.address)], _plan(inv), A, archive.parent, events.append)
    fed = [address for address, host in hosts.items() if host.fed]
    assert len(fed) == 1  # one copy left this machine
    by_source = {t.host: t.source for t in done}
    assert by_source[fed[0]] == "operator"
    assert all(by_source[a] in hosts and by_source[a] != a for a in hosts if a != fed[0])
    assert {t.codec for t in done} == {"zstd"} and {t.bytes_sent for t in done} == {1000}
    # Every secret went on stdin (the receiver's and the sender's, both ends) and appears in no command line.
    secrets = {line for host in hosts.values() for s in host.stdin for line in s.decode().split()}
    assert len(secrets) == 14
    commands = [c for host in hosts.values() for c in host.commands]
    assert not [c for c in commands if any(s in c for s in secrets)]
    # Each listener binds its own host's cluster address; every host's copy of the archive is removed after.
    for address, host in hosts.items():
        for command in host.commands:
            if LISTENER in command:
                assert f" {address} " in command
        assert any("; rm -f -- " in c for c in host.commands)
    assert any(isinstance(e, TransferProgress) and "→" in e.label for e in events)


def test_a_host_that_cannot_reach_its_peer_gets_the_image_from_the_operator(archive: Path) -> None:
    inv = _fleet(4)
    blocked = "192.0.2.13"
    hosts = {
        str(h.address): _host(
            str(h.address),
            **({"/dev/tcp/": CommandResult(3, "", "cannot reach x")} if str(h.address) == blocked else {}),
        )
        for h in inv.hosts
    }
    done = {t.host: t for t in distribute(inv, lambda h: hosts[str(h.address)], _plan(inv), A, archive.parent)}
    assert done[blocked].source.startswith("operator (after a peer copy failed: ")
    assert "cannot reach" in done[blocked].source
    assert hosts[blocked].fed  # the operator streamed it
    assert sum(bool(h.fed) for h in hosts.values()) == 2  # the seed and the fallback


def test_a_sender_whose_listener_fails_serves_no_one_else(archive: Path) -> None:
    inv = _fleet(4)
    hosts = {str(h.address): _host(str(h.address)) for h in inv.hosts}
    broken = CommandResult(1, "", "OSError: [Errno 98] Address already in use")
    fail_all = CommandResult(3, "", "cannot reach")
    for host in hosts.values():
        host.table.insert(0, (re.compile(LISTENER), broken))
        host.table.insert(0, (re.compile("/dev/tcp/"), fail_all))
    done = distribute(inv, lambda h: hosts[str(h.address)], _plan(inv), A, archive.parent)
    assert all(t.source.startswith("operator") for t in done)
    listeners = sum(LISTENER in c for h in hosts.values() for c in h.commands)
    assert listeners <= 3  # each failed sender tried once and was dropped


def test_a_host_without_bash_is_streamed_by_the_operator(archive: Path) -> None:
    inv = _fleet(3)
    hosts = {str(h.address): _host(str(h.address), tools="zstd\nsha256sum\n") for h in inv.hosts}
    done = distribute(inv, lambda h: hosts[str(h.address)], _plan(inv), A, archive.parent)
    assert all(h.fed for h in hosts.values())
    assert {t.source for t in done} == {"operator"}


def test_a_copy_that_loads_another_image_fails_naming_the_host(archive: Path) -> None:
    inv = _fleet(2)
    hosts = {str(h.address): _host(str(h.address), loaded=B) for h in inv.hosts}
    with pytest.raises(OperationError) as info:
        distribute(inv, lambda h: hosts[str(h.address)], _plan(inv), A, archive.parent)
    assert "expected aaaaaaaaaaaa" in info.value.message and "192.0.2.10" in info.value.message


def test_codec_and_decompressor() -> None:
    assert choose_codec({"zstd"}, [frozenset({"zstd"}), frozenset({"zstd", "bash"})]) == "zstd"
    assert choose_codec({"zstd"}, [frozenset({"zstd"}), frozenset({"bash"})]) == "gzip"
    assert choose_codec(set(), [frozenset({"zstd"})]) == "gzip"
    assert decompressor("gzip", frozenset({"pigz"})) == "pigz -dc"
    assert decompressor("gzip", frozenset()) == "gzip -dc"
    assert decompressor("zstd", frozenset({"zstd"})) == "zstd -dc"


def test_watch_stops_a_copy_that_stalls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "POLL_S", 0.01)
    monkeypatch.setattr(peers, "STALL_S", 0.1)
    host = Host("192.0.2.10", {"stat -c": "500", "kill -TERM": ""})
    seen: list[int] = []
    with peers.Watch(host, "/var/tmp/x.tar.zst", seen.append) as watch:
        for _ in range(200):
            if watch.stalled:
                break
            threading.Event().wait(0.01)
    assert watch.stalled and seen == [500]
    assert any("kill -TERM" in c for c in host.commands)


def test_watch_ends_without_a_stall_once_the_whole_archive_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy is complete; the host's `docker load` reads its file for longer than STALL_S (a 2 GB image on
    the fleet lab took 40–60 s): that is not a stalled copy. Ended as one, the operator sent it again."""
    monkeypatch.setattr(peers, "POLL_S", 0.01)
    monkeypatch.setattr(peers, "STALL_S", 0.1)
    host = Host("192.0.2.10", {"stat -c": "500", "kill -TERM": ""})
    seen: list[int] = []
    with peers.Watch(host, "/var/tmp/x.tar.zst", seen.append, total=500) as watch:
        threading.Event().wait(0.5)  # five times STALL_S
    assert not watch.stalled and seen == [500]
    assert not any("kill -TERM" in c for c in host.commands)


def test_commands_keep_secrets_off_the_command_line_and_bound_every_wait() -> None:
    copy = peers.Copy.new("192.0.2.10", "192.0.2.11", "10.0.0.10")
    listen = peers.listener_command(copy, "/var/tmp/raycluster-images/a.tar.zst", "img:1")
    taking = receive.receive_command("/var/tmp/raycluster-images/a.tar.zst", "d" * 64, "true", "10.0.0.10 20001")
    for secret in (copy.secret, copy.answer):
        assert secret and secret not in listen and secret not in taking
    assert copy.stdin == f"{copy.secret}\n{copy.answer}\n".encode()
    assert "docker run --rm -i --network host" in listen and f"timeout {peers.DEADLINE_S:.0f} python3" in listen
    assert f"timeout -k 5 {peers.DEADLINE_S:.0f}" in taking and "/dev/tcp/10.0.0.10/20001" in taking
    assert peers.PORTS[0] <= copy.port <= peers.PORTS[1]


def test_operator_streams_are_bounded(archive: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spread, "SEEDS", 1)
    inv = _fleet(6)
    hosts = {str(h.address): _host(str(h.address), tools="zstd\nsha256sum\n") for h in inv.hosts}  # no bash: direct
    assert len(distribute(inv, lambda h: hosts[str(h.address)], _plan(inv), A, archive.parent)) == 6


def test_each_host_keeps_the_archive_in_its_login_users_folder(archive: Path) -> None:
    """A non-root login gets /var/tmp/raycluster-images-<user>: a folder root made 0700 would refuse it."""
    text = "cluster: t\nimage: img:1\nhosts:\n  - {address: 192.0.2.10, role: head}\n"
    text += "  - {address: 192.0.2.11, ssh: {user: rayops}}\n  - {address: 192.0.2.12, ssh: {user: rayops}}\n"
    inv = parse(text)
    hosts = {str(h.address): _host(str(h.address)) for h in inv.hosts}
    distribute(inv, lambda h: hosts[str(h.address)], _plan(inv), A, archive.parent, lambda e: None)
    for address, folder in (("192.0.2.10", peers.ARCHIVE_DIR), ("192.0.2.11", peers.ARCHIVE_DIR + "-rayops")):
        other = peers.ARCHIVE_DIR + ("-rayops" if folder == peers.ARCHIVE_DIR else "/")
        touching = [c for c in hosts[address].commands if peers.ARCHIVE_DIR in c]
        assert touching and all(f"{folder}/" in c and other not in c for c in touching), touching
        assert any(f"; rm -f -- {folder}/" in c for c in touching)  # removed after, from the same folder


class Loading(Host):
    """A host whose `docker load` (the end of every receive) waits until every host has begun to receive (at
    most `limit` s); its receive command says PUBLISHED as its copy begins (before that wait), as one whose
    checksummed archive is whole before its load ends does."""

    def __init__(self, host: str, table: dict[str, CommandResult | str], fleet: Fleet, seed_waits: bool = True) -> None:
        super().__init__(host, table)
        self.fleet, self.seed_waits = fleet, seed_waits

    def _receive(self, command: str, on_line: Callable[[str], None] | None, wait: bool) -> bool:
        """Whether this receive checks the archive's checksum: it then says PUBLISHED before its load waits."""
        checks = "sha256sum" in command
        if checks and on_line is not None:
            on_line(peers.PUBLISHED)
        if wait:
            self.fleet.began(self.host)
        return checks

    @staticmethod
    def _said(result: CommandResult, checks: bool) -> CommandResult:
        return replace(result, stdout=f"{peers.PUBLISHED}\n{result.stdout}") if checks else result

    def run(self, command: str, *, on_line: Callable[[str], None] | None = None, **options: Any) -> CommandResult:
        if "/dev/tcp/" not in command:
            return super().run(command, **options)
        checks = self._receive(command, on_line, wait=True)
        return self._said(super().run(command, **options), checks)

    def feed(
        self, command: str, source: BinaryIO, *, on_line: Callable[[str], None] | None = None, **options: Any
    ) -> CommandResult:
        checks = self._receive(command, on_line, wait=self.seed_waits)
        return self._said(super().feed(command, source, **options), checks)


class Fleet:
    def __init__(self, count: int, limit: float) -> None:
        self.count, self.limit = count, limit
        self.receiving: list[str] = []
        self.all_began = threading.Event()
        self.loads_waited: list[bool] = []  # per load: whether every host had begun before it ended
        self.lock = threading.Lock()

    def began(self, host: str) -> None:
        with self.lock:
            self.receiving.append(host)
            if len(self.receiving) == self.count:
                self.all_began.set()
        self.loads_waited.append(self.all_began.wait(self.limit))


def test_a_host_serves_others_as_soon_as_its_archive_is_published_before_its_load_ends(
    archive: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each load here lasts until all 8 hosts have begun to receive: only hosts that serve while they load
    get there (served after their loads, the copies would follow one another: each load would end at its limit)."""
    inv = _fleet(8)
    fleet = Fleet(8, limit=5.0)
    tools = "zstd\nbash\ntimeout\nsha256sum\npython3\n"
    hosts = {str(h.address): Loading(str(h.address), _table(tools=tools), fleet) for h in inv.hosts}
    events: list[object] = []
    done = distribute(inv, lambda h: hosts[str(h.address)], _plan(inv), A, archive.parent, events.append)
    assert len(done) == 8 and sum(bool(h.fed) for h in hosts.values()) == 1  # still one copy from here
    assert fleet.loads_waited == [True] * 8  # no load ended before every host had begun to receive
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    receives = [c for h in hosts.values() for c in h.commands if "docker load" in c]
    assert len(receives) == 8 and all(digest in c for c in receives)  # each checks the operator's checksum
    assert (archive.parent / (archive.name + ".sha256")).read_text().strip() == digest  # computed once, kept
    assert {t.checksum for t in done} == {"sha256"} and {t.to_dict()["checksum"] for t in done} == {"sha256"}
    said = {e.split(":")[0] for e in events if isinstance(e, str) and "serves others while it loads" in e}
    senders = {t.source for t in done if t.source != "operator"}
    assert len(senders) >= 3 and senders <= said  # each host that served did so once its archive was published
    # A sender is free once its receiver's archive is published, not when that receiver's load ends: the holders
    # double each round (the seed serves a host in each of rounds 1, 2, 3), not a chain of one copy at a time.
    seed = next(t.host for t in done if t.source == "operator")
    assert sum(t.source == seed for t in done) >= 2, [(t.host, t.source) for t in done]


def test_a_host_with_no_tool_to_verify_is_refused_by_name_and_the_others_still_get_it(archive: Path) -> None:
    inv = _fleet(3)
    bare = "192.0.2.12"
    hosts = {
        str(h.address): _host(str(h.address), tools="zstd\nbash\ntimeout\n" if str(h.address) == bare else TOOLS)
        for h in inv.hosts
    }
    with pytest.raises(OperationError) as info:
        distribute(inv, lambda h: hosts[str(h.address)], _plan(inv), A, archive.parent)
    assert "1 host(s)" in info.value.message and f"{bare}: has no sha256sum, python3 or openssl" in info.value.message
    assert not hosts[bare].fed and not any("/dev/tcp/" in c for c in hosts[bare].commands)  # nothing sent there
    assert all(any("docker load" in c for c in h.commands) for a, h in hosts.items() if a != bare)


def test_a_peer_copy_that_arrives_corrupt_is_fetched_again_from_the_operator_and_its_sender_serves_no_more(
    archive: Path,
) -> None:
    inv = _fleet(4)
    corrupt = CommandResult(receive.CORRUPT_RC, "", f"{receive.CORRUPT} h: what arrived has SHA-256 0000…: not used")
    hosts = {str(h.address): _host(str(h.address), **{"/dev/tcp/": corrupt}) for h in inv.hosts}
    done = {t.host: t for t in distribute(inv, lambda h: hosts[str(h.address)], _plan(inv), A, archive.parent)}
    assert all(t.source.startswith("operator") for t in done.values())  # each corrupt peer copy: again from here
    fallbacks = [t for t in done.values() if t.source.startswith("operator (after")]
    assert fallbacks and all("arrived corrupt and was not used" in t.source for t in fallbacks)
    served = [sum(LISTENER in c for c in h.commands) for h in hosts.values()]
    assert max(served) == 1  # a sender whose copy was found corrupt served no one after


def test_an_operator_copy_that_arrives_corrupt_stops_the_run_naming_the_host(archive: Path) -> None:
    inv = _fleet(1)
    corrupt = CommandResult(receive.CORRUPT_RC, "", f"{receive.CORRUPT} h: what arrived has SHA-256 0000…: not used")
    hosts = {str(h.address): _host(str(h.address), **{"docker load": corrupt}) for h in inv.hosts}
    with pytest.raises(OperationError) as info:
        distribute(inv, lambda h: hosts[str(h.address)], _plan(inv), A, archive.parent)
    assert "192.0.2.10: the copy from the operator: image img:1 arrived corrupt and was not used" in info.value.message


def test_without_python3_a_host_serves_after_its_load_but_its_sender_is_free_once_its_archive_is_published(
    archive: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its listener runs in the image, which it has only once loaded. The seed's load ends at once here; every
    peer's lasts until all 7 have begun to receive: only a seed freed when each copy's archive is published,
    not when the receiver's load ends, serves all 7 before those loads end."""
    inv = _fleet(8)
    fleet = Fleet(7, limit=5.0)
    tools = "zstd\nbash\ntimeout\nsha256sum\n"
    hosts = {str(h.address): Loading(str(h.address), _table(tools=tools), fleet, seed_waits=False) for h in inv.hosts}
    events: list[object] = []
    done = distribute(inv, lambda h: hosts[str(h.address)], _plan(inv), A, archive.parent, events.append)
    seed = next(t.host for t in done if t.source == "operator")
    assert len(done) == 8 and {t.source for t in done if t.host != seed} == {seed}
    assert fleet.loads_waited == [True] * 7
    said = [e for e in events if isinstance(e, str) and "archive whole (SHA-256 checked)" in e]
    assert said and all(e.endswith("it loads (its listener needs the image)") for e in said)
    # Each peer copy's notice came from its own receive command; the seed's was of no use (nobody waited on it).
    assert sorted(e.split(":")[0] for e in said) == sorted(t.host for t in done if t.host != seed)
    assert {t.checksum for t in done} == {"sha256"}  # every copy verified before its load, the seed's too


@pytest.mark.parametrize("ready_first", [True, False])
def test_a_copy_that_ends_as_its_archive_is_published_frees_its_sender_once(archive: Path, ready_first: bool) -> None:
    """Both futures of one copy can be among those that `wait` returns together, in either order."""
    sender, receiver = (
        spread.Receiver(ImageTransfer(a, "missing", "stream"), a, _host(a), True) for a in ("192.0.2.10", "192.0.2.11")
    )
    job = image_job("img:1", A, archive, "zstd", "d" * 64)
    run = spread.Spread([receiver], job, lambda e: None)
    run.pending.clear()
    copy: Future[ImageTransfer] = Future()
    copy.set_result(ImageTransfer(receiver.host, "missing", "stream", source=sender.host))
    run.running[copy] = ("peer", receiver, sender)
    published = run._readiness(receiver, peer=True)
    assert published is not None
    published()
    (ready,) = run.ready
    run._settle([ready, copy] if ready_first else [copy, ready])
    assert not run.running and not run.ready
    assert sorted(r.host for r in run.idle) == [sender.host, receiver.host]  # each once: freed, and a holder
