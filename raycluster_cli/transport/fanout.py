"""Run one function on many hosts at once, bounded; every host gets its own result or error.

`fanout` returns a `GroupResult` (Fabric's GroupResult is the model): each item's value or exception,
`succeeded` and `failed` views, and `raise_failures()` that raises one error naming *every* failed host,
only after all of them finished — one bad host never hides the others. Iterating it still yields the
`(item, Outcome)` pairs older callers expect.

Cancellation: once `cancel.request()` was called (SIGINT/SIGTERM in the CLI), no queued item starts (it
gets a `Cancelled` outcome), and the caller's wait is not held up by items still running.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar, overload

from raycluster_cli import cancel
from raycluster_cli.errors import GroupError, error_text

T = TypeVar("T")
K = TypeVar("K")

log = logging.getLogger("raycluster.transport")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    value: T | None = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def label(item: object) -> str:
    """How a fan-out item is named in messages: its address (hosts), `host` (transfers), else str()."""
    for attribute in ("address", "host"):
        value = getattr(item, attribute, None)
        if value is not None:
            return str(value)
    return str(item)


def error_message(error: BaseException, host: str = "") -> str:
    """The one-line text of an error, without a leading "HOST: " when `host` is given (the caller names it)."""
    text = (str(error) or "interrupted") if isinstance(error, KeyboardInterrupt) else error_text(error)
    return text.removeprefix(f"{host}: ") if host else text


class GroupResult(Generic[K, T]):
    """Every item's outcome, in the order of the items. Iterates as `(item, Outcome)` pairs."""

    def __init__(self, pairs: list[tuple[K, Outcome[T]]], what: str = "") -> None:
        self.pairs = pairs
        self.what = what  # the phase, e.g. "start the workers": named in the combined error

    def __iter__(self) -> Iterator[tuple[K, Outcome[T]]]:
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    @overload
    def __getitem__(self, index: int) -> tuple[K, Outcome[T]]: ...
    @overload
    def __getitem__(self, index: slice) -> list[tuple[K, Outcome[T]]]: ...
    def __getitem__(self, index: int | slice) -> tuple[K, Outcome[T]] | list[tuple[K, Outcome[T]]]:
        return self.pairs[index]

    @property
    def succeeded(self) -> list[tuple[K, T]]:
        """(item, value) of every item that finished without an error."""
        return [(k, o.value) for k, o in self.pairs if o.error is None]  # type: ignore[misc]

    @property
    def failed(self) -> list[tuple[K, BaseException]]:
        """(item, error) of every item that raised, in item order."""
        return [(k, o.error) for k, o in self.pairs if o.error is not None]

    @property
    def ok(self) -> bool:
        return not any(o.error is not None for _, o in self.pairs)

    def values(self) -> list[T]:
        """The values of the items that succeeded, in order."""
        return [v for _, v in self.succeeded]

    def value_of(self) -> dict[str, T]:
        """Each succeeded item's value by its label (address)."""
        return {label(k): v for k, v in self.succeeded}

    def messages(self) -> list[tuple[str, str]]:
        """(label, one-line message) of every failure: what a report shows per host."""
        return [(label(k), error_message(e, label(k))) for k, e in self.failed]

    def check_interrupted(self) -> None:
        """Re-raise an interruption that reached any item (callers that report failures themselves)."""
        for _, error in self.failed:
            if isinstance(error, KeyboardInterrupt):
                raise error

    def raise_failures(self) -> None:
        """Raise one GroupError naming every failed item (after all finished); an interruption wins."""
        self.check_interrupted()
        failed = self.failed
        if failed:
            raise GroupError(self.what, [(label(k), e) for k, e in failed])


def fanout(items: Iterable[K], fn: Callable[[K], T], max_workers: int = 32, what: str = "") -> GroupResult[K, T]:
    """Call `fn` on each item in parallel (at most `max_workers` at once); one failing item never hides
    the others' results. Returns the outcomes in the order of `items`.
    """
    keys = list(items)
    if not keys:
        return GroupResult([], what)

    def guarded(key: K) -> T:
        cancel.check(f"{what or 'work'} on {label(key)}")  # queued work never starts after an interrupt
        return fn(key)

    pool = ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(keys))), thread_name_prefix="fanout")
    futures: list[tuple[K, Future[T]]] = []
    try:
        futures = [(key, pool.submit(guarded, key)) for key in keys]
        results = [(key, _outcome(future)) for key, future in futures]
    except BaseException:
        # Interrupted while waiting (Ctrl-C reaches the main thread here): stop the queue, do not wait
        # for the items still running (their transports are being closed), and let the caller unwind.
        cancel.request()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    failures = [label(k) for k, o in results if o.error is not None]
    if failures and what:
        log.debug("%s: %d of %d failed (%s)", what, len(failures), len(keys), ", ".join(failures))
    return GroupResult(results, what)


def _outcome(future: Future[T]) -> Outcome[T]:
    try:
        return Outcome(value=future.result())
    except cancel.Cancelled as exc:
        return Outcome(error=exc)
    except Exception as exc:
        return Outcome(error=exc)
