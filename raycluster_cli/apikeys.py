"""The service's API keys: what a key is, and the keys document the head keeps (pure; both sides import it).

The service never takes the Ray cluster's token: that token opens the dashboard's Jobs API, which runs code on
every node. A service key opens only the service's routes. The operator keeps each key it made in a 0600 file;
the head's container keeps only their SHA-256 digests, names and limits in one JSON document, which the ingress
reads again whenever it changes (so a key revoked there is refused at once, without a restart).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from dataclasses import asdict, dataclass
from typing import Any

NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}", re.ASCII)
KEY_PATTERN = re.compile(r"[A-Za-z0-9._~+/=-]{24,512}", re.ASCII)
_DIGEST = re.compile(r"[0-9a-f]{64}", re.ASCII)
MAX_KEYS = 1000
DEFAULT_NAME = "default"


def new_key() -> str:
    """A fresh key: 256 random bits, with a prefix that tells it apart from the cluster's Ray token."""
    return "rcs-" + secrets.token_urlsafe(32)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"key name {name!r}: use 1-64 lower-case letters, digits, '.', '_' or '-'")
    return name


def check_key(key: str, where: str) -> str:
    """A key as read from a file: one line of 24-512 token characters, or an error naming ``where``."""
    key = key.strip()
    if not KEY_PATTERN.fullmatch(key):
        raise ValueError(f"{where}: not an API key (one line of 24-512 letters, digits or ._~+/=-)")
    return key


@dataclass(frozen=True)
class KeyEntry:
    """One key as the head knows it: never the key itself, only its digest, and what it may use at once."""

    name: str
    sha256: str
    created: int = 0
    max_requests: int | None = None  # requests in flight at once with this key (None: the service's own bound)
    max_tokens: int | None = None  # tokens its requests in flight may hold (prompt + max_tokens, times n)

    @classmethod
    def make(cls, name: str, key: str, **limits: int | None) -> KeyEntry:
        return cls(check_name(name), digest(key), int(time.time()), **limits)


def _limit(raw: Any, field: str) -> int | None:
    if raw is None:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
        raise ValueError(f"{field}: {raw!r} is not a positive whole number")
    return raw


def parse_keys(text: str) -> list[KeyEntry]:
    """The keys document (``{"keys": [{"name", "sha256", "created", "max_requests", "max_tokens"}]}``), checked
    whole: a bad entry fails the document, naming the entry and the field."""
    data = json.loads(text)
    rows = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(rows, list) or len(rows) > MAX_KEYS:
        raise ValueError(f"keys: a list of at most {MAX_KEYS} entries")
    entries, names = [], set()
    for i, row in enumerate(rows):
        where = f"keys[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: not an object")
        name, sha = str(row.get("name", "")), str(row.get("sha256", ""))
        check_name(name)
        if not _DIGEST.fullmatch(sha):
            raise ValueError(f"{where}.sha256: not a SHA-256 digest in hex")
        if name in names:
            raise ValueError(f"{where}.name: {name!r} is listed twice")
        names.add(name)
        created = row.get("created", 0)
        entries.append(
            KeyEntry(
                name,
                sha,
                created if isinstance(created, int) else 0,
                _limit(row.get("max_requests"), f"{where}.max_requests"),
                _limit(row.get("max_tokens"), f"{where}.max_tokens"),
            )
        )
    return entries


def render_keys(entries: list[KeyEntry]) -> str:
    return json.dumps({"keys": [asdict(e) for e in entries]}, indent=1) + "\n"


def merged(kept: list[KeyEntry], added: list[KeyEntry]) -> list[KeyEntry]:
    """``kept`` with ``added`` put in (an added key replaces a kept one of the same name, in its place)."""
    new = {e.name: e for e in added}
    out = [new.pop(e.name, e) for e in kept]
    return out + list(new.values())
