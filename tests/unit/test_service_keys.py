"""The service's own API keys and its TLS pair: the keys document, the ingress's check and per-key limits, the
operator's add / revoke / list against a head that keeps the document (the TLS pair: tests/local/test_tls_loopback.py)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli import apikeys
from raycluster_cli.config import inventory
from raycluster_cli.errors import UsageError
from raycluster_cli.serve.auth import KeyLimits, ServiceKeys
from raycluster_cli.serve.protocol import APIError
from raycluster_cli.transport.base import CommandResult
from raycluster_cli.verbs import serve_keys

INVENTORY = """
cluster: demo
image: raycluster/node:0.1.0
hosts:
  - {address: 127.0.0.1, role: head}
"""


def test_the_keys_document_holds_digests_only_and_is_checked_whole() -> None:
    key = apikeys.new_key()
    entry = apikeys.KeyEntry.make("team-a", key, max_requests=4)
    text = apikeys.render_keys([entry])
    assert key not in text and apikeys.digest(key) in text
    assert apikeys.parse_keys(text) == [entry]
    for bad, field in (
        ({"keys": [{"name": "A B", "sha256": "0" * 64}]}, "key name"),
        ({"keys": [{"name": "a", "sha256": "xyz"}]}, "keys[0].sha256"),
        ({"keys": [{"name": "a", "sha256": "0" * 64}, {"name": "a", "sha256": "1" * 64}]}, "listed twice"),
        ({"keys": [{"name": "a", "sha256": "0" * 64, "max_requests": 0}]}, "keys[0].max_requests"),
        ({"keys": "a"}, "keys:"),
    ):
        with pytest.raises(ValueError, match=re.escape(field)):
            apikeys.parse_keys(json.dumps(bad))
    with pytest.raises(ValueError, match="not an API key"):
        apikeys.check_key("short", "f")


def test_the_ingress_reads_its_keys_again_when_they_change_and_refuses_the_ray_token(tmp_path: Path) -> None:
    path, token = tmp_path / "keys.json", tmp_path / "auth-token"
    token.write_text("ray-cluster-token-0123456789abcdef\n")
    first, second = apikeys.new_key(), apikeys.new_key()
    path.write_text(apikeys.render_keys([apikeys.KeyEntry.make("first", first)]))
    keys = ServiceKeys(str(path), str(token))
    assert keys.check(f"Bearer {first}").name == "first"
    for header in ("", "Bearer", f"Basic {first}", f"Bearer {second}"):
        with pytest.raises(APIError) as refused:
            keys.check(header)
        assert refused.value.status == 401
    with pytest.raises(APIError, match="Ray cluster's token"):
        keys.check("Bearer ray-cluster-token-0123456789abcdef")
    temp = tmp_path / "keys.new"  # rewritten whole and moved into place, as the operator does
    temp.write_text(apikeys.render_keys([apikeys.KeyEntry.make("second", second)]))
    temp.replace(path)
    assert keys.check(f"Bearer {second}").name == "second"
    with pytest.raises(APIError):
        keys.check(f"Bearer {first}")  # revoked: refused without a restart
    path.write_text("{damaged")  # a bad document keeps the last good keys
    assert keys.check(f"Bearer {second}").name == "second"
    assert ServiceKeys(None).check("").name == "open"
    with pytest.raises(APIError):  # a document never read: every key is refused
        ServiceKeys(str(tmp_path / "missing.json")).check(f"Bearer {first}")


def test_a_key_over_its_limits_gets_429_and_each_release_counts_once() -> None:
    limits = KeyLimits(default_requests=2, default_tokens=None)
    small = apikeys.KeyEntry("small", "0" * 64, max_requests=None, max_tokens=100)
    other = apikeys.KeyEntry("other", "1" * 64)
    a = limits.take(small, 60)
    with pytest.raises(APIError) as over:
        limits.take(small, 50)
    assert over.value.status == 429 and over.value.headers["Retry-After"] and over.value.code == "rate_limit_exceeded"
    b = limits.take(small, 40)  # the tokens fit; the requests default (2) is reached
    with pytest.raises(APIError, match="2 requests in flight"):
        limits.take(small, 1)
    c = limits.take(other, 10**6)  # another key is not held back by this one
    a()
    a()  # released twice: counted once
    assert limits.in_flight() == {"small": {"requests": 1, "tokens": 40}, "other": {"requests": 1, "tokens": 10**6}}
    b()
    c()
    assert limits.in_flight() == {}


class Head:
    """The head's container as `docker exec` sees it: one file system, written from stdin."""

    host = "127.0.0.1"

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.commands: list[str] = []

    def run(self, command: str, stdin: bytes | None = None, **_: Any) -> CommandResult:
        self.commands.append(command)
        if " cat /tmp/" in command:
            path = command.rsplit(" ", 1)[1]
            if path in self.files:
                return CommandResult(0, self.files[path].decode(), "")
            return CommandResult(1, "", "No such file or directory")
        if command.startswith("docker exec -i") and "umask 077" in command:
            path = command.split("mv -f ")[1].split(" ")[1].strip("'\"")
            self.files[path] = stdin or b""
            return CommandResult(0, "", "")
        return CommandResult(127, "", f"unexpected: {command}")


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Head]:
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path / "state"))
    return inventory.parse(INVENTORY, "inv.yaml"), Head()


def test_keys_are_added_listed_and_revoked_on_the_head_and_kept_here_0600(cluster: tuple[Any, Head]) -> None:
    inv, head = cluster
    connect: Any = lambda _host: head  # noqa: E731
    default = serve_keys.put_keys(inv, connect)
    added = serve_keys.add_key(inv, connect, "team-a", max_requests=3)
    key = Path(str(added.key_file)).read_text().strip()
    assert os.stat(str(added.key_file)).st_mode & 0o777 == 0o600 and key.startswith("rcs-")
    document = head.files[serve_keys.KEYS_IN_CONTAINER].decode()
    assert key not in document and key not in " ".join(head.commands)  # never on a command line, never on the head
    listed = serve_keys.list_keys(inv, connect).to_dict()["keys"]
    assert [(r["name"], r["max_requests"]) for r in listed] == [("default", None), ("team-a", 3)]
    assert serve_keys.put_keys(inv, connect) == default  # a second serve keeps team-a and the same default key
    assert [e.name for e in serve_keys.head_keys(inv, connect)] == ["default", "team-a"]
    serve_keys.revoke_key(inv, connect, "team-a")
    assert [e.name for e in serve_keys.head_keys(inv, connect)] == ["default"]
    assert not Path(str(added.key_file)).exists()
    with pytest.raises(UsageError, match="no key 'team-a'"):
        serve_keys.revoke_key(inv, connect, "team-a")
    with pytest.raises(UsageError, match="key name"):
        serve_keys.add_key(inv, connect, "Team A")


def test_an_operators_own_key_file_becomes_the_default_key(cluster: tuple[Any, Head], tmp_path: Path) -> None:
    inv, head = cluster
    mine = tmp_path / "mine"
    mine.write_text("my-own-api-key-of-enough-length-123\n")
    path = serve_keys.put_keys(inv, lambda _h: head, str(mine))  # type: ignore[arg-type,return-value]
    assert path.read_text().strip() == "my-own-api-key-of-enough-length-123"
    assert apikeys.digest("my-own-api-key-of-enough-length-123") in head.files[serve_keys.KEYS_IN_CONTAINER].decode()
    mine.write_text("short")
    with pytest.raises(UsageError, match="not an API key"):
        serve_keys.ensure_default_key(inv, str(mine))


def test_the_services_settings_hold_no_secret(tmp_path: Path) -> None:
    """The settings travel to Ray (pickled, shown in Serve's dashboard and logs): they name the keys document, whose
    entries are digests, and hold no key or token of their own."""
    from dataclasses import fields

    from raycluster_cli.serve.image_app import ImageSettings
    from raycluster_cli.serve.settings import ServeSettings

    key = apikeys.new_key()
    path = tmp_path / "keys.json"
    path.write_text(apikeys.render_keys([apikeys.KeyEntry.make("default", key)]))
    for settings in (ServeSettings("/m", keys_file=str(path)), ImageSettings("/m", keys_file=str(path))):
        assert key not in repr(settings) and not {"token", "key", "api_key"} & {f.name for f in fields(settings)}
