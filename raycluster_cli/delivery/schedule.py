"""Scheduling the relay over a fleet (node images and models alike): the operator seeds one host, then every
host that has the content serves one that lacks it, so the number of holders doubles each round (O(log N)
rounds for N hosts) while the operator uploads one copy. A host whose peer copy fails (unreachable, stalled,
or its bytes did not match the operator's SHA-256) is served by the operator (as Dragonfly's peers go back to
the source); a sender whose listener failed, or whose copy arrived corrupt, serves no one else.

A copy is done for the scheduler as soon as the receiver's file is whole and its SHA-256 is the operator's
(delivery/receive.py publishes it then, before it is used), not when the receiver's use of it (`docker load`, a
model's unpack) ends: its sender is free to serve the next host, and a receiver whose listener runs on the
host's own python3 (or in the node image the host already has: models) serves others from then on, while
it uses its copy. A round then takes the copy's time, and the uses run side by side. A host without python3
receiving the image runs its listener in that image, so it serves once its load is done.

What travels is a Job: its bytes here, their SHA-256, and what the host does with them once verified.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

from raycluster_cli import cancel
from raycluster_cli.delivery import peer_copy
from raycluster_cli.delivery.receive import CORRUPT, SENDER_UNPROVEN, receive_command, receive_script
from raycluster_cli.errors import OperationError
from raycluster_cli.progress import Progress, TransferProgress
from raycluster_cli.transport import CommandResult, Transport
from raycluster_cli.transport.fanout import Outcome

OPERATOR_STREAMS = 4  # hosts the operator streams to at once (seeds and fallbacks; its uplink is shared)
SEEDS = 1  # hosts the operator seeds before peers take over


@dataclass(frozen=True)
class Delivery:
    """What the relay did (or has to do) about its content (the node image, a model) on one host."""

    host: str
    reason: str  # "missing" / "different image ID …"
    method: str  # "stream" / "pull"
    seconds: float = 0.0
    bytes_sent: int = 0  # bytes this host received
    codec: str = ""
    source: str = ""  # "operator", the address of the peer that served it, or "operator (after …)"
    checksum: str = ""  # "sha256": what it received matched the operator's SHA-256 before it was used

    def to_dict(self) -> dict[str, object]:
        return {
            "host": self.host,
            "reason": self.reason,
            "method": self.method,
            "seconds": round(self.seconds, 2),
            "bytes_sent": self.bytes_sent,
            "codec": self.codec,
            "source": self.source,
            "checksum": self.checksum,
        }


ImageTransfer = Delivery  # the name `up`'s documents and callers know


@dataclass(frozen=True)
class Job:
    """What travels: the same for every copy of one relay."""

    what: str  # for messages: "image img:1", "model tiny (3f2a…)"
    name: str  # the file's name in each host's staging folder
    size: int  # its bytes
    digest: str  # their SHA-256 (hex): a receiver uses nothing else
    open: Callable[[], AbstractContextManager[BinaryIO]]  # the bytes on this machine, from the start
    use: Callable[[Receiver], str]  # shell text that uses the verified file "$a" on the receiver
    verify: Callable[[Receiver, CommandResult], None]  # raises when that use did not do what it must
    listener_image: str  # whose python3 runs a listener on a host without python3
    image_on_hosts: bool = False  # that image is on every receiver already: all of them serve before their use ends
    codec: str = ""
    noun: str = "archive"  # what the progress lines call the file on a host
    uses: str = "loads"  # and what the host does with it

    def remote(self, directory: str = peer_copy.ARCHIVE_DIR) -> str:
        """Where a host keeps its copy while it may serve others (`directory`: its login user's staging folder)."""
        return f"{directory}/{self.name}"


@dataclass
class Receiver:
    """One host that lacks the content, and what the scheduler knows about it."""

    transfer: Delivery
    address: str  # its cluster address (where its listener binds when it serves)
    transport: Transport
    peer_ok: bool  # has bash and timeout: can receive from a peer
    fallback: str = ""  # why its peer copy failed (then the operator serves it)
    result: Outcome[Delivery] | None = None
    serves: bool = True  # False once its listener failed or its copy was found corrupt by another host
    listens: bool = False  # can serve others before its own use ends (python3 here, or the image already here)
    serving: bool = False  # already among the holders (its copy whole and verified, or its copy done)
    archive_dir: str = peer_copy.ARCHIVE_DIR  # its staging folder (host/folders.archive_dir)
    tools: frozenset[str] = frozenset()  # what TOOLS_COMMAND found there

    @property
    def host(self) -> str:
        return self.transfer.host


class Spread:
    def __init__(self, receivers: list[Receiver], job: Job, progress: Progress) -> None:
        self.receivers, self.job, self.progress = receivers, job, progress
        self.pending: deque[Receiver] = deque(r for r in receivers if r.peer_ok)
        self.direct: deque[Receiver] = deque(r for r in receivers if not r.peer_ok)
        self.idle: deque[Receiver] = deque()  # holders free to serve
        self.running: dict[Future[Delivery], tuple[str, Receiver, Receiver | None]] = {}
        self.ready: dict[Future[None], Receiver] = {}  # set by a copy's watch once its archive is published
        self.seeded = 0

    def run(self) -> list[Receiver]:
        """Every receiver ends with a result (its transfer, or why it failed)."""
        pool = ThreadPoolExecutor(max_workers=OPERATOR_STREAMS + len(self.receivers), thread_name_prefix="spread")
        try:
            while self.pending or self.direct or self.running:
                cancel.check("image distribution")
                self._start(pool)
                watched: list[Future[Any]] = [*self.running, *self.ready]
                finished, _ = wait(watched, return_when=FIRST_COMPLETED)
                self._settle(finished)
        except BaseException:
            # Interrupted (Ctrl-C reaches this thread): start nothing more and do not wait for the copies
            # still running; their transports are being closed and the hosts' guards end their commands.
            cancel.request()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return self.receivers

    def _settle(self, finished: Iterable[Future[Any]]) -> None:
        """Ended copies and published archives, in any order (both of one copy can come at once)."""
        for future in finished:
            if future in self.running:
                self._finish(future)
            elif (published := self.ready.pop(future, None)) is not None:  # not if its copy just ended
                self._published(published)

    @staticmethod
    def _may_hold(receiver: Receiver) -> bool:
        """Whether `receiver` can still join the holders (it receives from peers, its listener never failed,
        and it has not joined yet)."""
        return receiver.peer_ok and receiver.serves and not receiver.serving

    def _hold(self, receiver: Receiver) -> None:
        """`receiver` has the archive: it joins the holders that serve others (once)."""
        if self._may_hold(receiver):
            receiver.serving = True
            self.idle.append(receiver)

    def _free(self, sender: Receiver) -> None:
        """A sender whose copy is done serves again, unless its listener failed."""
        if sender.serves:
            self.idle.append(sender)

    def _published(self, receiver: Receiver) -> None:
        """`receiver`'s archive is whole and checked: the host that sent it (its listener done) is free again,
        without waiting for the receiver's load, and a receiver that listens without the image serves others
        from now on."""
        if receiver.listens:
            self._hold(receiver)
        for future, (kind, each, sender) in list(self.running.items()):
            if each is receiver and sender is not None:
                self.running[future] = (kind, each, None)  # freed here, not again when the copy ends
                self._free(sender)

    def _readiness(self, receiver: Receiver, peer: bool) -> Callable[[], None] | None:
        """What `receiver`'s copy calls once its file is published (verified whole), or None when there is no use in
        knowing before the copy ends. Called where its copy is scheduled (this thread), which waits on the result.
        Worth knowing for a peer copy (its sender is freed) and for a host that serves early."""
        early = receiver.listens and self._may_hold(receiver)
        if not (peer or early):
            return None
        future: Future[None] = Future()
        self.ready[future] = receiver
        uses = self.job.uses
        then = f"it serves others while it {uses}" if early else f"it {uses} (its listener needs the image)"

        def published() -> None:
            self.progress(f"{receiver.host}: {self.job.noun} whole (SHA-256 checked); {then}")
            future.set_result(None)

        return published

    def _operator_next(self) -> Receiver | None:
        """Fallbacks first; then seeds, and more of them only when no holder is or will soon be free."""
        if self.direct:
            return self.direct.popleft()
        will_hold = any(kind == "peer" or r.peer_ok for kind, r, _ in self.running.values())
        if self.pending and (self.seeded < SEEDS or not (self.idle or will_hold)):
            self.seeded += 1
            return self.pending.popleft()
        return None

    def _start(self, pool: ThreadPoolExecutor) -> None:
        while sum(kind == "operator" for kind, _, _ in self.running.values()) < OPERATOR_STREAMS:
            receiver = self._operator_next()
            if receiver is None:
                break
            ready = self._readiness(receiver, peer=False)
            self.running[pool.submit(self._stream, receiver, ready)] = ("operator", receiver, None)
        while self.idle and self.pending:
            sender, receiver = self.idle.popleft(), self.pending.popleft()
            ready = self._readiness(receiver, peer=True)
            self.running[pool.submit(self._peer, sender, receiver, ready)] = ("peer", receiver, sender)

    def _finish(self, future: Future[Delivery]) -> None:
        kind, receiver, sender = self.running.pop(future)
        for waiting in [f for f, r in self.ready.items() if r is receiver]:  # its copy ended unpublished
            del self.ready[waiting]
        error = future.exception()
        if error is None:
            receiver.result = Outcome(value=future.result())
            self._hold(receiver)
        elif kind == "operator":
            receiver.result = Outcome(error=error)
        else:
            receiver.fallback = getattr(error, "message", str(error))
            self.direct.append(receiver)
        if sender is not None:
            self._free(sender)

    # the two kinds of copy ------------------------------------------------------------------------------

    def _stream(self, receiver: Receiver, on_ready: Callable[[], None] | None = None) -> Delivery:
        """The operator sends the bytes over the receiver's SSH connection."""
        started = time.monotonic()
        total = self.job.size
        sent = 0
        self.progress(TransferProgress(receiver.host, 0, total, label=self._label("operator", receiver)))

        def on_sent(count: int) -> None:
            nonlocal sent
            sent += count
            self.progress(TransferProgress(receiver.host, sent, total, label=self._label("operator", receiver)))

        archive = self.job.remote(receiver.archive_dir)
        command = receive_script(receive_command(archive, self.job.digest, self.job.use(receiver)))
        with self.job.open() as source:
            result = receiver.transport.feed(
                command, source, on_sent=on_sent, timeout=peer_copy.DEADLINE_S, on_line=_told(on_ready)
            )
        self.progress(TransferProgress(receiver.host, sent, total, done=True, label=self._label("operator", receiver)))
        self._check(receiver, result, "the copy from the operator")
        after = f" (after a peer copy failed: {receiver.fallback})" if receiver.fallback else ""
        return self._done(receiver, "operator" + after, started, sent, result)

    def _label(self, source: str, receiver: Receiver) -> str:
        """The progress bar's name: "image → HOST" from the operator, "model SENDER → HOST" from a peer."""
        kind = self.job.what.split(" ", 1)[0]
        return f"{kind} → {receiver.host}" if source == "operator" else f"{kind} {source} → {receiver.host}"

    def _peer(self, sender: Receiver, receiver: Receiver, on_ready: Callable[[], None] | None = None) -> Delivery:
        """`sender` serves its copy to `receiver` over the cluster network."""
        started = time.monotonic()
        total = self.job.size
        copy = peer_copy.Copy.new(sender.host, receiver.host, sender.address)
        heard: list[CommandResult | BaseException] = []

        def listen() -> None:
            try:
                command = peer_copy.listener_command(copy, self.job.remote(sender.archive_dir), self.job.listener_image)
                heard.append(sender.transport.run(command, stdin=copy.stdin, timeout=peer_copy.DEADLINE_S + 60))
            except BaseException as exc:
                heard.append(exc)

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        label = self._label(sender.host, receiver)
        self.progress(TransferProgress(receiver.host, 0, total, label=label))
        archive = self.job.remote(receiver.archive_dir)
        source = f"{copy.address} {copy.port}"
        command = receive_script(receive_command(archive, self.job.digest, self.job.use(receiver), source))
        report = lambda n: self.progress(TransferProgress(receiver.host, n, total, label=label))  # noqa: E731
        with peer_copy.Watch(receiver.transport, archive, report, total) as watch:
            result = receiver.transport.run(
                command, stdin=copy.stdin, timeout=peer_copy.DEADLINE_S + 60, on_line=_told(on_ready)
            )
        listener.join(peer_copy.CONNECT_S + 60)
        self.progress(TransferProgress(receiver.host, total, total, done=True, label=label))
        if not result.ok and (_listener_failed(heard[0] if heard else None) or _said(result, CORRUPT)):
            sender.serves = False  # its listener broke, or what it served did not match: it serves no one else
        if watch.stalled:
            why = _listener_said(heard[0] if heard else None)
            raise OperationError(
                f"{receiver.host}: no byte from {sender.host} for {peer_copy.STALL_S:.0f}s "
                f"({watch.seen / 1e6:.0f} of {total / 1e6:.0f} MB had arrived{'; the listener: ' + why if why else ''})",
                "",
            )
        self._check(receiver, result, f"the copy from {sender.host}")
        return self._done(receiver, sender.host, started, total, result)

    def _done(self, receiver: Receiver, source: str, started: float, size: int, result: CommandResult) -> Delivery:
        return replace(
            receiver.transfer,
            method="stream",
            seconds=time.monotonic() - started,
            bytes_sent=size,
            codec=self.job.codec,
            source=source,
            checksum="sha256" if peer_copy.PUBLISHED in result.stdout.splitlines() else "",
        )

    def _check(self, receiver: Receiver, result: CommandResult, what: str) -> None:
        """The receive command verified the bytes before their use; the job checks what the use did."""
        if not result.ok:
            corrupt = _said(result, CORRUPT)
            if corrupt:
                raise OperationError(
                    f"{receiver.host}: {what}: {self.job.what} arrived corrupt and was not used ({corrupt})",
                    f"check {receiver.host}'s network and disk; run again (it is sent again)",
                )
            unproven = _said(result, SENDER_UNPROVEN)
            raise OperationError(
                f"{receiver.host}: {what} failed: {unproven or result.first_line()}",
                f"check free disk space on {receiver.host} (df -h {receiver.archive_dir}) and run again",
            )
        self.job.verify(receiver, result)


def _said(result: CommandResult, marker: str) -> str:
    """The first line of a command's stderr that starts with `marker`, without it ("" when none)."""
    for line in result.stderr.splitlines():
        if line.startswith(marker):
            return line[len(marker) :].strip()
    return ""


def _told(on_ready: Callable[[], None] | None) -> Callable[[str], None] | None:
    """What reads a receive command's lines as they come: `on_ready` once it says its archive was published."""
    if on_ready is None:
        return None
    return lambda line: on_ready() if line == peer_copy.PUBLISHED else None


def _listener_said(heard: CommandResult | BaseException | None) -> str:
    """The sender's listener's own word on a copy that went wrong ("" when it served it or is not done)."""
    if heard is None:
        return ""
    if isinstance(heard, CommandResult):
        return "" if heard.ok else heard.first_line()
    text = str(heard).strip()
    return text.splitlines()[0] if text else type(heard).__name__


def _listener_failed(heard: CommandResult | BaseException | None) -> bool:
    """Whether a failed copy was the sender's fault: its listener broke (not: no receiver ever came)."""
    if isinstance(heard, CommandResult):
        return not heard.ok and "no receiver presented" not in heard.stderr
    return heard is not None
