"""Scheduling an image over a fleet: the operator seeds one host, then every host that has the image
serves one that lacks it, so the number of holders doubles each round (O(log N) rounds for N hosts) while
the operator uploads one copy. A host whose peer copy fails is served by the operator (as Dragonfly's
peers go back to the source); a sender whose listener failed serves no one else.

A copy is done for the scheduler as soon as the receiver's archive is whole and its checksum matches the
operator's (peer_copy.receive_command publishes it then), not when the receiver's `docker load` ends: its
sender is free to serve the next host, and a receiver whose listener runs on the host's own python3 serves
others from then on, while it loads. A round then takes the copy's time, and the loads (most of the time
of a multi-GB image) run side by side. A host without python3 runs its listener in the image, so it serves
once its load is done.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from raycluster_cli import cancel
from raycluster_cli.errors import OperationError
from raycluster_cli.host.engine import image_id
from raycluster_cli.image import peer_copy
from raycluster_cli.progress import Progress, TransferProgress
from raycluster_cli.transport import CommandResult, Transport
from raycluster_cli.transport.fanout import Outcome

OPERATOR_STREAMS = 4  # hosts the operator streams to at once (seeds and fallbacks; its uplink is shared)
SEEDS = 1  # hosts the operator seeds before peers take over


@dataclass(frozen=True)
class ImageTransfer:
    """What `up` did (or has to do) about the image on one host."""

    host: str
    reason: str  # "missing" / "different image ID …"
    method: str  # "stream" / "pull"
    seconds: float = 0.0
    bytes_sent: int = 0  # bytes of the archive this host received
    codec: str = ""
    source: str = ""  # "operator", the address of the peer that served it, or "operator (after …)"
    checksum: str = ""  # "sha256": its archive matched the operator's SHA-256 as it arrived ("": not checked)

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


@dataclass(frozen=True)
class Job:
    """What travels: the same for every copy of one distribution."""

    image: str
    image_id: str
    archive: Path  # the compressed archive on this machine
    codec: str
    digest: str = ""  # the archive's SHA-256 (hex): a copy that matches is done before the receiver's load

    def remote(self, directory: str = peer_copy.ARCHIVE_DIR) -> str:
        """Where a host keeps its copy of the archive while it may serve others (`directory`: its login user's)."""
        return peer_copy.archive_path(self.image_id, self.archive.name.split(".", 1)[1], directory)


@dataclass
class Receiver:
    """One host that lacks the image, and what the scheduler knows about it."""

    transfer: ImageTransfer
    address: str  # its cluster address (where its listener binds when it serves)
    transport: Transport
    decompress: str
    peer_ok: bool  # has bash and timeout: can receive from a peer
    fallback: str = ""  # why its peer copy failed (then the operator serves it)
    result: Outcome[ImageTransfer] | None = None
    serves: bool = True  # False once its listener failed
    sums: bool = False  # has sha256sum: can check its copy as it arrives (its sender is then free)
    listens: bool = False  # has python3 for its listener: can serve others before its own load ends
    serving: bool = False  # already among the holders (its archive whole, or its copy done)
    archive_dir: str = peer_copy.ARCHIVE_DIR  # where this host keeps the archive (host/folders.archive_dir)

    @property
    def host(self) -> str:
        return self.transfer.host


class Spread:
    def __init__(self, receivers: list[Receiver], job: Job, progress: Progress) -> None:
        self.receivers, self.job, self.progress = receivers, job, progress
        self.pending: deque[Receiver] = deque(r for r in receivers if r.peer_ok)
        self.direct: deque[Receiver] = deque(r for r in receivers if not r.peer_ok)
        self.idle: deque[Receiver] = deque()  # holders free to serve
        self.running: dict[Future[ImageTransfer], tuple[str, Receiver, Receiver | None]] = {}
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

    def _readiness(self, receiver: Receiver, peer: bool) -> tuple[str, Callable[[], None] | None]:
        """The digest to check on `receiver` and what its watch calls once its copy is published ("", None: no
        use in knowing before the copy ends). Called where its copy is scheduled (this thread), which waits on
        the result. Worth knowing for a peer copy (its sender is freed) and for a host that serves early."""
        early = receiver.listens and self._may_hold(receiver)
        if not (self.job.digest and receiver.sums and (peer or early)):
            return "", None
        future: Future[None] = Future()
        self.ready[future] = receiver
        then = "it serves others while it loads" if early else "it loads (its listener needs the image)"

        def published() -> None:
            self.progress(f"{receiver.host}: archive whole (SHA-256 checked); {then}")
            future.set_result(None)

        return self.job.digest, published

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
            self.running[pool.submit(self._stream, receiver, *ready)] = ("operator", receiver, None)
        while self.idle and self.pending:
            sender, receiver = self.idle.popleft(), self.pending.popleft()
            ready = self._readiness(receiver, peer=True)
            self.running[pool.submit(self._peer, sender, receiver, *ready)] = ("peer", receiver, sender)

    def _finish(self, future: Future[ImageTransfer]) -> None:
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

    def _stream(
        self, receiver: Receiver, digest: str = "", on_ready: Callable[[], None] | None = None
    ) -> ImageTransfer:
        """The operator sends its archive over the receiver's SSH connection."""
        started = time.monotonic()
        total = self.job.archive.stat().st_size
        sent = 0
        self.progress(TransferProgress(receiver.host, 0, total))

        def on_sent(count: int) -> None:
            nonlocal sent
            sent += count
            self.progress(TransferProgress(receiver.host, sent, total))

        archive = self.job.remote(receiver.archive_dir)
        command = peer_copy.receive_script(
            peer_copy.receive_command(archive, receiver.decompress, self.job.image, "", digest)
        )
        with self.job.archive.open("rb") as source:
            result = receiver.transport.feed(
                command, source, on_sent=on_sent, timeout=peer_copy.DEADLINE_S, on_line=_told(on_ready)
            )
        self.progress(TransferProgress(receiver.host, sent, total, done=True))
        self._check(receiver, result, "docker load")
        after = f" (after a peer copy failed: {receiver.fallback})" if receiver.fallback else ""
        return self._done(receiver, "operator" + after, started, sent, result)

    def _peer(
        self, sender: Receiver, receiver: Receiver, digest: str = "", on_ready: Callable[[], None] | None = None
    ) -> ImageTransfer:
        """`sender` serves its copy of the archive to `receiver` over the cluster network."""
        started = time.monotonic()
        total = self.job.archive.stat().st_size
        copy = peer_copy.Copy.new(sender.host, receiver.host, sender.address)
        secret = (copy.secret + "\n").encode()
        heard: list[CommandResult | BaseException] = []

        def listen() -> None:
            try:
                command = peer_copy.listener_command(copy, self.job.remote(sender.archive_dir), self.job.image)
                heard.append(sender.transport.run(command, stdin=secret, timeout=peer_copy.DEADLINE_S + 60))
            except BaseException as exc:
                heard.append(exc)

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        label = f"image {sender.host} → {receiver.host}"
        self.progress(TransferProgress(receiver.host, 0, total, label=label))
        archive = self.job.remote(receiver.archive_dir)
        command = peer_copy.receive_script(
            peer_copy.receive_command(
                archive, receiver.decompress, self.job.image, f"{copy.address} {copy.port}", digest
            )
        )
        report = lambda n: self.progress(TransferProgress(receiver.host, n, total, label=label))  # noqa: E731
        with peer_copy.Watch(receiver.transport, archive, report, total) as watch:
            result = receiver.transport.run(
                command, stdin=secret, timeout=peer_copy.DEADLINE_S + 60, on_line=_told(on_ready)
            )
        listener.join(peer_copy.CONNECT_S + 60)
        self.progress(TransferProgress(receiver.host, total, total, done=True, label=label))
        if not result.ok and _listener_failed(heard[0] if heard else None):
            sender.serves = False
        if watch.stalled:
            why = _listener_said(heard[0] if heard else None)
            raise OperationError(
                f"{receiver.host}: no byte from {sender.host} for {peer_copy.STALL_S:.0f}s "
                f"({watch.seen / 1e6:.0f} of {total / 1e6:.0f} MB had arrived{'; the listener: ' + why if why else ''})",
                "",
            )
        self._check(receiver, result, f"copy from {sender.host}")
        return self._done(receiver, sender.host, started, total, result)

    def _done(self, receiver: Receiver, source: str, started: float, size: int, result: CommandResult) -> ImageTransfer:
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
        """The receive command prints the loaded image's ID last: it must be the operator's."""
        if not result.ok:
            raise OperationError(
                f"{receiver.host}: {what} failed: {result.first_line()}",
                f"check free disk space on {receiver.host} (df -h /var/lib/docker) and retry `raycluster up`",
            )
        lines = result.stdout.strip().splitlines()
        found = image_id(lines[-1]) if lines else ""
        if found != self.job.image_id:
            raise OperationError(
                f"{receiver.host}: after docker load, {self.job.image} is {found[7:19] or 'missing'}, "
                f"expected {self.job.image_id[7:19]}",
                "the image may have been re-tagged meanwhile: re-run `raycluster up`",
            )


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
