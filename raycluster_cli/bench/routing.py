"""Requests to replicas of unequal speed: in proportion to each one's measured seconds per request, or equally.

Pure Python (the operator side imports it without torch).  ``assign`` gives every request the replica where it
would finish first (``pick``), counting what that replica already holds (``(held + 1) × seconds``): a replica 4× faster gets
4× the requests, and the last ones land where they end soonest.  ``equal`` is the round-robin every replica gets
the same share from: the reference a speed-weighted run is compared with.
"""

from __future__ import annotations

from collections.abc import Sequence


def assign(total: int, seconds: Sequence[float], policy: str = "weighted") -> list[int]:
    """The replica index of each of ``total`` requests under ``policy`` (``weighted`` or ``equal``)."""
    if not seconds:
        raise ValueError("no replica to route to")
    if any(s <= 0 for s in seconds):
        raise ValueError(f"seconds per request must be positive, got {list(seconds)}")
    if policy == "equal":
        return [i % len(seconds) for i in range(total)]
    if policy != "weighted":
        raise ValueError(f"routing policy {policy!r}: use 'weighted' or 'equal'")
    held = [0] * len(seconds)
    out: list[int] = []
    for _ in range(total):
        best = pick(held, seconds)
        held[best] += 1
        out.append(best)
    return out


def pick(held: Sequence[int], seconds: Sequence[float]) -> int:
    """The replica where one more request would finish first, ``held`` being what each already has (ties: the
    lowest index): the weighted rule for one request at a time, as the image service routes them."""
    return min(range(len(seconds)), key=lambda i: ((held[i] + 1) * seconds[i], i))


def counts(assignment: Sequence[int], replicas: int) -> list[int]:
    found = [0] * replicas
    for index in assignment:
        found[index] += 1
    return found
