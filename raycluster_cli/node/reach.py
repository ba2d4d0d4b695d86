"""Which nodes can reach each other: a cut between two workers that both still answer the head.

The head reaches every node (the liveness ping goes from the ingress on the head), but a pipeline's stages also talk
to each other: the direct links' ring (gloo connects every pair of ranks when it forms) and, on Ray's relay, a step
larger than Ray's inline limit fetched by the next stage from the previous one's object store.  A firewall rule or a
broken route between two workers leaves both answering pings while no step gets through; the stall deadline alone
then fails the pipeline, and its replacement over the same nodes would stall again.

So a node tries a TCP connection to the Ray object manager port of each other node (the port every node-to-node
transfer of Ray's uses), within a short deadline (``unreachable``); two nodes are cut when either one cannot connect
to the other (``cut_pairs``), and a pipeline is planned only over nodes with no cut between any two of them
(``connected``).  Pure functions and sockets: the stage actors (serve/stages.py) and the fleet's probe tasks
(serve/fleet.py) run them on the nodes.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

REACH_TIMEOUT_S = 2.0  # a TCP connection to a peer that does not open within this: not reachable


def _connects(ip: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def unreachable(targets: Sequence[tuple[str, str, int]], timeout_s: float = REACH_TIMEOUT_S) -> list[str]:
    """The names of ``targets`` (name, ip, port) this process could not open a TCP connection to within
    ``timeout_s``, all tried at once."""
    if not targets:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        opened = list(pool.map(lambda t: _connects(t[1], t[2], timeout_s), targets))
    return [name for (name, _, _), ok in zip(targets, opened, strict=True) if not ok]


def cut_pairs(reports: Mapping[str, Iterable[str]]) -> set[frozenset[str]]:
    """Each node's unreachable peers (``reports``: node -> the names it could not reach) as pairs: two nodes are
    cut when either could not reach the other."""
    return {frozenset((node, peer)) for node, peers in reports.items() for peer in peers if peer != node}


def connected(order: Sequence[str], cuts: set[frozenset[str]]) -> list[str]:
    """The nodes of ``order`` (the first preferred) taken one by one when they have no cut with any taken before:
    a set over which every pair reaches the other."""
    taken: list[str] = []
    for node in order:
        if all(frozenset((node, other)) not in cuts for other in taken):
            taken.append(node)
    return taken


def describe(cuts: set[frozenset[str]], names: Mapping[str, str]) -> str:
    """The cut pairs for a person: "10.0.0.2 <-> 10.0.0.3", by ``names`` (node -> its address) where known."""
    pairs = sorted(sorted(names.get(n, n) for n in pair) for pair in cuts)
    return ", ".join(" <-> ".join(pair) for pair in pairs)
