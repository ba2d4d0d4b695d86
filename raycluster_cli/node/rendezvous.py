"""How a pipeline's ring of direct links (``node.links``) forms without any store on the network.

gloo's rendezvous needs a store the ranks share: each rank writes its address record (its listener's address) and
reads everyone else's.  A ``TCPStore`` would listen for anyone who reaches the port: it lists its keys to a
stranger, stores whatever a stranger writes, and a forged address record raced in before a rank reads it decides
where that rank connects.  Here every rank's store is its own process's (``RayRendezvous``); what gloo writes into
it is carried by Ray's calls, which the cluster's token authenticates:

1. ``offer``: every rank starts its group on a thread; once gloo has written its record and waits for the others',
   the record is handed back (the stages' over a Ray call to the engine, the engine's own in process);
2. ``join``: the engine gives every rank all the records (and the ring's secret, over the same calls); each rank's
   gloo connects to its peers, then every link proves the secret (``prove``) before any step is read from it;
3. only when every rank has proven its links does any stage start its loop (``StageActor.run_links``).

Nothing listens but gloo's own listener on each rank (bound to the node's Ray address, open while the ring lives; a
connection to it reaches no step: every link was connected and proven when the ring formed).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from raycluster_cli.node.links import CONNECT_TIMEOUT_S, ring_group

AUTH_TAG = 2  # the tag of each link's proof (steps travel on node.links' MESSAGE_TAG and BODY_TAG)
PROOF_BYTES = 32  # an HMAC-SHA256


class LinksRefused(RuntimeError):
    """A link's peer did not prove the ring's secret (or no record came in time): the ring does not form."""


class RayRendezvous(dist.Store):
    """One rank's store for gloo's rendezvous, in its own process only: what gloo sets is kept to be handed to the
    other ranks over Ray (``published``); a get waits until the engine's records arrive (``learn``), until the
    ring's deadline at most."""

    def __init__(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        super().__init__()
        self.published: dict[str, bytes] = {}
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._asking = False  # gloo waits for a key it does not have: it has written all it will this round
        self._over = False  # the group's thread ended (formed or failed): nothing more will be published
        self._deadline = time.monotonic() + timeout_s

    def _left(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def set(self, key: str, value: Any) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        with self._changed:
            self._values[key] = self.published[key] = data
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        self.wait([key])
        with self._changed:
            return self._values[key]

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        with self._changed:
            if not all(k in self._values for k in keys):
                self._asking = True
                self._changed.notify_all()
            if not self._changed.wait_for(lambda: all(k in self._values for k in keys), self._left()):
                raise LinksRefused(f"no address record for {sorted(set(keys) - set(self._values))} in time")

    def check(self, keys: Sequence[str]) -> bool:
        with self._changed:
            return all(k in self._values for k in keys)

    def num_keys(self) -> int:
        with self._changed:
            return len(self._values)

    def over(self) -> None:
        with self._changed:
            self._over = True
            self._changed.notify_all()

    def offered(self) -> dict[str, bytes]:
        """This rank's records, once gloo waits for the others' (or its thread ended)."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._asking or self._over, self._left()):
                raise LinksRefused("gloo wrote no address record in time")
            return dict(self.published)

    def learn(self, records: Mapping[str, bytes]) -> None:
        with self._changed:
            self._values.update({k: v for k, v in records.items() if k not in self.published})
            self._changed.notify_all()


def proof(secret: bytes, sender: int, receiver: int) -> bytes:
    """What ``sender`` sends ``receiver`` on their link: the ring's secret's HMAC of the direction, so one link's
    proof, seen or seized, proves nothing on any other link or in any other ring (each ring has its own secret)."""
    return hmac.new(secret, f"raycluster-link {sender}->{receiver}".encode(), hashlib.sha256).digest()


def prove(group: Any, rank: int, size: int, secret: bytes, timeout_s: float) -> None:
    """Every link of ``rank`` proves the secret both ways before any step is read from it: a connection that gloo's
    listener took from a stranger (one that connected first) sends no valid proof, and the ring does not form.  The
    receive posted here takes ``PROOF_BYTES`` only: a stranger's bytes never reach a step's buffer."""
    peers = [r for r in range(size) if r != rank]
    got = {peer: torch.zeros(PROOF_BYTES, dtype=torch.uint8) for peer in peers}
    asked = [(peer, group.recv([got[peer]], peer, AUTH_TAG)) for peer in peers]
    mine = [torch.frombuffer(bytearray(proof(secret, rank, peer)), dtype=torch.uint8) for peer in peers]
    sent = [group.send([message], peer, AUTH_TAG) for message, peer in zip(mine, peers, strict=True)]
    deadline = time.monotonic() + timeout_s

    def left() -> datetime.timedelta:
        return datetime.timedelta(seconds=max(0.001, deadline - time.monotonic()))

    for peer, work in asked:
        try:
            work.wait(left())
        except RuntimeError as exc:
            raise LinksRefused(f"rank {peer} sent no proof of the ring's secret within {timeout_s:.0f} s") from exc
        if not hmac.compare_digest(bytes(got[peer].numpy()), proof(secret, peer, rank)):
            raise LinksRefused(f"the link from rank {peer} did not prove the ring's secret: refused")
    for work in sent:
        work.wait(left())


class Joining:
    """One rank of a ring in formation: its gloo group built on a thread over its own ``RayRendezvous``."""

    def __init__(self, rank: int, size: int, my_ip: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.store = RayRendezvous(timeout_s)
        self.group: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._build, args=(my_ip,), name="raycluster-ring", daemon=True)
        self.thread.start()

    def _build(self, my_ip: str) -> None:
        try:
            self.group = ring_group(self.store, self.rank, self.size, my_ip)
        except BaseException as exc:
            self.error = exc
        finally:
            self.store.over()

    def offer(self) -> dict[str, bytes]:
        """This rank's address records, to be handed to every rank."""
        records = self.store.offered()
        if self.error is not None:
            raise LinksRefused(f"rank {self.rank}'s links did not start: {self.error}")
        return records

    def join(self, records: Mapping[str, bytes], secret: bytes) -> Any:
        """The group, once gloo connected it with ``records`` and every link proved ``secret``."""
        self.store.learn(records)
        self.thread.join(max(0.0, self.deadline - time.monotonic()))
        if self.thread.is_alive():
            raise LinksRefused(f"rank {self.rank}'s links did not connect within {self.timeout_s:.0f} s")
        if self.error is not None or self.group is None:
            raise LinksRefused(f"rank {self.rank}'s links did not connect: {self.error}")
        group, self.group = self.group, None  # a refused ring's group is dropped with the exception: its links close
        prove(group, self.rank, self.size, secret, max(1.0, self.deadline - time.monotonic()))
        return group


def merged(offers: Sequence[Mapping[str, bytes]]) -> dict[str, bytes]:
    """Every rank's records together; one key offered twice, by two ranks, is a ring that cannot form."""
    records: dict[str, bytes] = {}
    for offer in offers:
        for key, value in offer.items():
            if key in records and records[key] != value:
                raise LinksRefused(f"two ranks offered the address record {key!r}")
            records[key] = value
    return records


async def form_ring(stages: Sequence[Any], my_ip: str, capacity: int, timeout_s: float = CONNECT_TIMEOUT_S) -> Any:
    """The engine's group (rank 0) of a ring over ``stages`` (rank i + 1: actors with ``offer_links``,
    ``join_links`` and ``run_links``), each stage's loop running; raises when it does not form within
    ``timeout_s``, and then no stage runs a loop.  Three Ray calls per stage, at formation only."""
    import asyncio
    import secrets

    size = len(stages) + 1
    mine = Joining(0, size, my_ip, timeout_s)
    offers = asyncio.gather(
        asyncio.to_thread(mine.offer), *(s.offer_links.remote(i + 1, size) for i, s in enumerate(stages))
    )
    records = merged(await asyncio.wait_for(offers, timeout_s))
    secret = secrets.token_bytes(32)  # this ring's only: handed to its stages over Ray's token-checked calls
    joined = asyncio.gather(*(s.join_links.remote(records, secret, capacity) for s in stages))
    group, _ = await asyncio.wait_for(
        asyncio.gather(asyncio.to_thread(mine.join, records, secret), joined), timeout_s + 10
    )
    await asyncio.wait_for(asyncio.gather(*(s.run_links.remote() for s in stages)), timeout_s)
    return group
