"""Run one function on many hosts at once, bounded; every host gets its own result or error."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    value: T | None = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def fanout(items: Iterable[K], fn: Callable[[K], T], max_workers: int = 32) -> list[tuple[K, Outcome[T]]]:
    """Call `fn` on each item in parallel; one failing item never hides the others' results.

    Returns (item, outcome) pairs in the order of `items`.
    """
    keys = list(items)
    if not keys:
        return []
    results: list[tuple[K, Outcome[T]]] = []
    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(keys)))) as pool:
        futures = [(key, pool.submit(fn, key)) for key in keys]
        for key, future in futures:
            try:
                results.append((key, Outcome(value=future.result())))
            except Exception as exc:
                results.append((key, Outcome(error=exc)))
    return results
