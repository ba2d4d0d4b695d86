"""A Connect wrapper that counts remote commands per host (run, feed and put are one remote command each)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, BinaryIO

from raycluster_cli.config.inventory import HostConfig
from raycluster_cli.transport import CommandResult, Transport


class CountingTransport:
    def __init__(self, inner: Transport, counts: Counter[str], log: list[tuple[str, str]]) -> None:
        self.inner = inner
        self.host = inner.host
        self.counts = counts
        self.log = log

    def _count(self, command: str) -> None:
        self.counts[self.host] += 1
        self.log.append((self.host, command))

    def run(self, command: str, **options: Any) -> CommandResult:
        self._count(command)
        return self.inner.run(command, **options)

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        self._count(f"put {path}")
        self.inner.put(data, path, mode)

    def feed(self, command: str, source: BinaryIO, **options: Any) -> CommandResult:
        self._count(command)
        return self.inner.feed(command, source, **options)

    def close(self) -> None:
        self.inner.close()


class CountingConnect:
    """`connect` for the library that hands out counting wrappers; `counts[address]` = remote commands."""

    def __init__(self, connect: Callable[[HostConfig], Any]) -> None:
        self.connect = connect
        self.counts: Counter[str] = Counter()
        self.log: list[tuple[str, str]] = []
        self._wrapped: dict[str, CountingTransport] = {}

    def __call__(self, host: HostConfig) -> CountingTransport:
        key = str(host.address)
        if key not in self._wrapped:
            self._wrapped[key] = CountingTransport(self.connect(host), self.counts, self.log)
        return self._wrapped[key]
