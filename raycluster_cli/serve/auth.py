"""Who may call the service, and how much each caller may hold at once: the check both ingresses share (through
serve/ingress.py's dependency).

The keys are the service's own (``raycluster_cli.apikeys``): the ingress reads the head's keys document (digests
only) and reads it again whenever its size, inode or modification time change, so ``serve --keys revoke NAME``
takes effect on the next request. The Ray cluster's token is refused by name: it opens the cluster's Jobs API, and
an API client must never need it. Each key's requests and tokens in flight are counted (``KeyLimits``): over its
limits a request gets 429 with Retry-After, as OpenAI's API answers a client over its rate.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raycluster_cli.apikeys import KeyEntry, parse_keys
from raycluster_cli.serve.protocol import APIError

log = logging.getLogger(__name__)
OPEN = KeyEntry("open", "0" * 64)  # the caller when auth is off (loopback tests only)
# Ray Serve's proxy stops watching a client that sends this header, so a generation would outlive its client:
# the service refuses it rather than hold slots for nobody.
DISCONNECT_DISABLED_HEADER = "x-request-disconnect-disabled"


def _sha(value: bytes) -> str:
    return hashlib.sha256(value).hexdigest()


class ServiceKeys:
    """The keys of ``path`` (a keys document), re-read when the file changes; ``None``: no auth at all."""

    def __init__(self, path: str | None, cluster_token_path: str | None = None) -> None:
        self.path = Path(path) if path else None
        self._seen: tuple[int, int, int] | None = None
        self._entries: list[KeyEntry] = []
        self._cluster = self._read_token(cluster_token_path)
        if self.path is not None:
            self._reload()

    @staticmethod
    def _read_token(path: str | None) -> str | None:
        if not path:
            return None
        try:
            return _sha(Path(path).read_bytes().strip())
        except OSError:
            return None

    def _reload(self) -> None:
        assert self.path is not None
        try:
            st = self.path.stat()
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
            if seen == self._seen:
                return
            self._entries = parse_keys(self.path.read_text())
            self._seen = seen
        except (OSError, ValueError) as exc:  # keep the last good keys; with none yet, every key is refused
            log.warning("the service's keys %s could not be read: %s", self.path, exc)

    def names(self) -> list[str]:
        if self.path is not None:
            self._reload()
        return [e.name for e in self._entries]

    def check(self, authorization: str) -> KeyEntry:
        """The key an ``Authorization`` header carries, or 401 saying what to send."""
        scheme, _, given = authorization.partition(" ")
        return self.check_bearer(given if scheme.lower() == "bearer" else None)

    def check_bearer(self, given: str | None) -> KeyEntry:
        """The key of a bearer credential (None: no bearer credential sent), or 401 saying what to send; the Ray
        cluster's token is refused by name."""
        if self.path is None:
            return OPEN
        self._reload()
        if given is not None and given.strip():
            sha = _sha(given.strip().encode())
            found = next((e for e in self._entries if hmac.compare_digest(e.sha256, sha)), None)
            if found is not None:
                return found
            if self._cluster is not None and hmac.compare_digest(self._cluster, sha):
                raise APIError(
                    401,
                    "that is the Ray cluster's token, which this service never takes: send one of the service's"
                    " keys (raycluster serve --keys list)",
                )
        raise APIError(401, "missing or wrong API key: send Authorization: Bearer <a service key>")


@dataclass
class _Use:
    requests: int = 0
    tokens: int = 0


@dataclass
class KeyLimits:
    """Requests and tokens in flight per key (a single event loop's counters: no lock)."""

    default_requests: int | None = None
    default_tokens: int | None = None
    retry_after_s: int = 2
    _use: dict[str, _Use] = field(default_factory=dict)

    def take(self, key: KeyEntry, tokens: int) -> Callable[[], None]:
        """Count one request of ``tokens`` for ``key``, or 429 when it would pass a limit; returns its release
        (idempotent: a streamed answer releases when its stream ends, however it ends)."""
        use = self._use.setdefault(key.name, _Use())
        most_requests = key.max_requests or self.default_requests
        most_tokens = key.max_tokens or self.default_tokens
        if most_requests is not None and use.requests + 1 > most_requests:
            raise APIError(
                429,
                f"key {key.name!r} has {use.requests} requests in flight, its limit; retry later",
                code="rate_limit_exceeded",
                retry_after=self.retry_after_s,
            )
        if most_tokens is not None and use.tokens + tokens > most_tokens:
            raise APIError(
                429,
                f"key {key.name!r} holds {use.tokens} tokens in flight; this request's {tokens} would pass its"
                f" limit of {most_tokens}; retry later",
                code="rate_limit_exceeded",
                retry_after=self.retry_after_s,
            )
        use.requests += 1
        use.tokens += tokens
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                use.requests -= 1
                use.tokens -= tokens

        return release

    def in_flight(self) -> dict[str, dict[str, int]]:
        return {name: {"requests": u.requests, "tokens": u.tokens} for name, u in self._use.items() if u.requests}


def cluster_token_path() -> str | None:
    """The Ray token's file in this container (what the service refuses by name), when Ray has one."""
    return os.environ.get("RAY_AUTH_TOKEN_PATH") or None


def refuse_disconnect_disabled(headers: Any) -> None:
    getter = getattr(headers, "get", None)
    if getter is not None and getter(DISCONNECT_DISABLED_HEADER) is not None:
        raise APIError(
            400,
            f"the header {DISCONNECT_DISABLED_HEADER} is not accepted: a generation ends when its client leaves",
            param=DISCONNECT_DISABLED_HEADER,
        )
