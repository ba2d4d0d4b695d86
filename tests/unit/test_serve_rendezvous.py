"""The direct links' rendezvous (node.rendezvous) over real gloo groups on loopback: each rank's store is its own
process's, the address records are handed round as the engine hands them over Ray, and every link proves the ring's
secret before a step is read.  A stranger finds no store to read or write, and a rank without the secret is refused
by every peer."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from typing import Any

import psutil
import pytest
import torch

from raycluster_cli.node.links import DirectLinks, StageLoop
from raycluster_cli.node.rendezvous import Joining, LinksRefused, merged

dist = pytest.importorskip("torch.distributed")


def _listening() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN"}


STRANGER = """
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), 3, False, timeout=datetime.timedelta(seconds=3))
store.set("0/1", b"forged")
print("ANSWERED", store.list_keys(), flush=True)
"""


def _store_answers(host: str, port: int) -> bool:
    """A stranger's process tries ``host:port`` as torch's store: connect, write a forged address record, list the
    keys.  Against gloo's listener the client waits for an answer that never comes (past its own deadline): its
    process is ended after a few seconds."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", STRANGER, host, str(port)], capture_output=True, text=True, timeout=8
        )
    except subprocess.TimeoutExpired:
        return False
    return "ANSWERED" in done.stdout


def _form(secrets: list[bytes], timeout_s: float = 30) -> dict[int, Any]:
    """Each rank's group or the exception its join raised; rank i proves ``secrets[i]``."""
    size = len(secrets)
    joining = [Joining(rank, size, "127.0.0.1", timeout_s) for rank in range(size)]
    records = merged([j.offer() for j in joining])
    found: dict[int, Any] = {}

    def join(rank: int) -> None:
        try:
            found[rank] = joining[rank].join(records, secrets[rank])
        except BaseException as exc:
            found[rank] = exc

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    return found


def test_a_rank_without_the_ring_s_secret_is_refused_by_every_peer() -> None:
    """Rank 2 is a stranger in a rank's place (it reached the links, not the engine's Ray calls): its links' proofs
    are wrong, so the ranks beside it refuse the ring, and it refuses theirs; nobody reads a step from it."""
    found = _form([b"the-ring-s", b"the-ring-s", b"a-guess"])
    assert all(isinstance(found[rank], LinksRefused) for rank in range(3)), found
    assert "rank 2 did not prove the ring's secret" in str(found[0])
    assert "rank 2 did not prove the ring's secret" in str(found[1])
    assert "rank 0 did not prove the ring's secret" in str(found[2])


def test_no_store_answers_a_stranger_and_the_ring_carries_steps_after_his_tries() -> None:
    """Every port the ring listens on, tried as torch's store by a stranger: none answers (nothing to list, nothing
    to write, no address record to forge); gloo's own listeners take his connections and the ring is unharmed."""
    before = _listening()
    found = _form([b"s3cret"] * 3)
    opened = _listening() - before
    assert opened, "the ring opened no listener (gloo's): nothing was tried"
    for host, port in opened:
        assert not _store_answers(host, port), f"a store answered a stranger on {host}:{port}"
    loop = StageLoop(found[1], 1, 3, lambda x, table: x * 2)
    last = StageLoop(found[2], 2, 3, lambda x, table: x[:, -1, :])
    loop.start()
    last.start()

    async def step() -> torch.Tensor:
        links = DirectLinks(found[0], 3)
        links.start()
        logits, _ = await asyncio.wait_for(links.run(torch.ones(1, 2, 4), torch.tensor([[0], [0], [2]])), 30)
        links.close()
        return logits

    assert torch.equal(asyncio.run(step()), torch.full((1, 4), 2.0))


def test_two_ranks_offering_one_record_differently_cannot_form_a_ring() -> None:
    with pytest.raises(LinksRefused, match="two ranks offered the address record '0/1'"):
        merged([{"0/0": b"a", "0/1": b"b"}, {"0/1": b"c"}])
