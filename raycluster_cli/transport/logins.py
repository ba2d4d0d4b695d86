"""Logins started from the last run's routes, before the inventory is read (the start of a 1-host verb).

On one host `doctor`, `status` and `down` are mostly the interpreter's start, the imports and one SSH login,
and the login waits on the host (its sshd) more than on this machine: the sooner it starts, the more of it
overlaps the imports. cli/ahead.py starts it before the CLI's imports, but it still needs the inventory read
and validated first (pydantic and the inventory's models: about a third of the time to the login).

So each run keeps, per inventory file, what it logged in with: every host's `SSHPool.login_params` (address,
user, port, key, known_hosts policy, deadlines) and the login gate's width, stamped with what they were
derived from (the inventory's bytes, the ssh config file's bytes, the working folder, $HOME). The next run of
the same command line reads that stamp before anything else; if it still holds, it starts those logins at
once, with only paramiko imported. Nothing is trusted on the stamp alone: once the CLI has validated the
inventory, each host's login is adopted only if the validated inventory gives the very same parameters
(`QuickLogins.take`), and any other is closed unused. A host behind a jump host is never started this way.

It also keeps, per command line, the recipe of the first read-only command on each host (prefetch.py): never
a command. Once the inventory is validated, cli/ahead.py has the code make that command again (`supply`).

The file holds no secret (no key, no token: paths and settings) and is written only when it changes, under
the state folder with the user's own permissions.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any

from raycluster_cli.config.paths import resolve_path, state_root
from raycluster_cli.transport import prefetch
from raycluster_cli.transport.gate import Ahead, LoginGate
from raycluster_cli.transport.ssh import SSHTransport

VERSION = 2  # 2: per command line, the recipes of the first read-only commands, no longer the commands
MAX_BYTES = 1 << 20  # an inventory larger than this is not stamped (inventory.py caps what it reads too)


def cache_file(inventory_path: Path) -> Path:
    """Where the routes of the inventory at this (resolved) path are kept."""
    digest = hashlib.sha256(str(inventory_path).encode()).hexdigest()[:24]
    return state_root() / "logins" / f"{digest}.json"


def _digest(path: str | None) -> str | None:
    """The sha256 of a file's bytes; "absent" when it is not there; None for no file."""
    if not path:
        return None
    try:
        with open(os.path.expanduser(path), "rb") as handle:
            return hashlib.sha256(handle.read(MAX_BYTES + 1)).hexdigest()
    except OSError:
        return "absent"


def stamp(inventory_bytes: bytes, ssh_config_file: str | None) -> dict[str, Any]:
    """Everything the routes were derived from, besides the code (a new version gives a new stamp)."""
    from raycluster_cli import __version__

    return {
        "version": VERSION,
        "raycluster": __version__,
        "inventory": hashlib.sha256(inventory_bytes).hexdigest(),
        "ssh_config_file": ssh_config_file,
        "ssh_config": _digest(ssh_config_file),
        "cwd": os.getcwd(),
        "home": os.path.expanduser("~"),
    }


def _read(path: Path) -> bytes | None:
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except OSError:
        return None
    return data if len(data) <= MAX_BYTES else None


class QuickLogins:
    """The logins started from a cache: handed to the pool host by host (`take`), the rest closed (`discard`)."""

    def __init__(self, parallel: int, started: dict[str, tuple[dict[str, Any], SSHTransport, Ahead]]) -> None:
        self.parallel = parallel
        self.gate = LoginGate(parallel)
        self._started = started
        self._lock = threading.Lock()
        self._discarded: set[str] = set()
        self._taken: set[str] = set()  # handed to the pool (the login threads still see every host)
        # Per host, the read-only command the last run of this command line began with, made again by the code
        # from the validated inventory (`supply`): run right after the login, its result waiting for the CLI.
        self._first: dict[str, tuple[str, float | None, prefetch.Pending]] = {}

    def start(self) -> None:
        queue = deque(self._started)
        for _ in range(min(len(queue), self.parallel)):
            threading.Thread(target=self._log_in_queued, args=(queue,), name="login-cached", daemon=True).start()

    def _log_in_queued(self, queue: deque[str]) -> None:
        while True:
            with self._lock:
                if not queue:
                    return
                address = queue.popleft()
                _, transport, ahead = self._started[address]
                if address in self._discarded:
                    continue
                ahead.started = True
            ahead.attempt(transport.connect)  # its failure handed to the host's first user, as in SSHPool
            with self._lock:
                ahead.done.set()
                discarded = address in self._discarded
                if discarded:
                    transport.close()
                first = self._first.get(address)
            if first is not None and ahead.error is None and not discarded:
                self._start_first(transport, first)

    @staticmethod
    def _start_first(transport: SSHTransport, first: tuple[str, float | None, prefetch.Pending]) -> None:
        # In a thread of its own: the login thread logs in to the next host meanwhile.
        threading.Thread(target=transport.start_ahead, args=first, name="read-ahead", daemon=True).start()

    def supply(self, address: str, blanked: str, timeout: float | None) -> None:
        """Start `blanked` (made by the code: prefetch.build) on this host as soon as its login has ended."""
        with self._lock:
            entry = self._started.get(address)
            if entry is None or address in self._discarded or address in self._first:
                return
            _, transport, ahead = entry
            first = (blanked, timeout, transport.expect(blanked, timeout))
            self._first[address] = first
            ended = ahead.done.is_set()
        if ended and ahead.error is None:
            self._start_first(transport, first)

    def take(self, address: str, params: dict[str, Any] | None) -> tuple[SSHTransport, Ahead] | None:
        """This host's login, if it was started with exactly `params` (once); else None."""
        with self._lock:
            entry = self._started.get(address)
            if entry is None or params is None or entry[0] != params or address in self._discarded | self._taken:
                return None
            self._taken.add(address)
            return entry[1], entry[2]

    def discard(self) -> None:
        """Close every login not taken (now if it has ended, else as soon as it does)."""
        with self._lock:
            for address, (_, transport, ahead) in self._started.items():
                if address in self._taken:
                    continue
                self._discarded.add(address)
                if ahead.done.is_set() or not ahead.started:
                    transport.close()


def command_line_key(argv: list[str]) -> str:
    return json.dumps(argv)


def start(explicit: str | None) -> tuple[QuickLogins | None, dict[str, Any] | None]:
    """Start the logins the last run of this inventory made, if its stamp still holds.

    Returns the logins (None: nothing started) and the cache document read (for `save` to compare, and
    `first_recipes` to read the read-only commands the same command line began with)."""
    path = resolve_path(explicit).resolve()
    data = _read(path)
    cached = _read(cache_file(path))
    if data is None or cached is None:
        return None, None
    try:
        document = json.loads(cached)
        if document["stamp"] != stamp(data, document["stamp"]["ssh_config_file"]):
            return None, document
        parallel = int(document["parallel"])
        started = {
            str(address): (params, SSHTransport(**params), Ahead()) for address, params in document["logins"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, None  # not a document this version wrote: the next save replaces it
    quick = QuickLogins(parallel, started)
    for _, transport, _ in started.values():
        transport.gate = quick.gate
    quick.start()
    return quick, document


def first_recipes(document: dict[str, Any] | None, argv: list[str]) -> dict[str, Any]:
    """Per host, the recipe (prefetch.Recipe, unchecked: prefetch.build checks it) of the read-only command
    the last run of the command line `argv` began with; only recipes are kept, never a command."""
    if not isinstance(document, dict) or not isinstance(document.get("first"), dict):
        return {}
    kept = document["first"].get(command_line_key(argv))
    return {str(address): recipe for address, recipe in kept.items()} if isinstance(kept, dict) else {}


KEPT_COMMAND_LINES = 8  # per inventory, the most recent command lines whose first commands are kept


def save(
    path: Path,
    ssh_config_file: str | None,
    parallel: int,
    logins: dict[str, dict[str, Any]],
    seen: dict[str, Any] | None,
    argv: list[str] | None = None,
    first: dict[str, prefetch.Recipe] | None = None,
) -> None:
    """Keep these logins for the next run of the inventory at `path` (resolved), and the recipe of the
    read-only command this command line `argv` began with per host (`first`); written only if changed.

    Best effort: a state folder that cannot be written costs only the next run's head start."""
    data = _read(path)
    if data is None:
        return
    document: dict[str, Any] = {"stamp": stamp(data, ssh_config_file), "parallel": parallel, "logins": logins}
    kept: dict[str, Any] = {}
    if seen is not None and seen.get("stamp") == document["stamp"] and isinstance(seen.get("first"), dict):
        kept = dict(seen["first"])
    if argv is not None:
        key = command_line_key(argv)
        kept.pop(key, None)
        if first:
            kept[key] = dict(first)  # the newest last
    document["first"] = dict(list(kept.items())[-KEPT_COMMAND_LINES:])
    if document == seen:
        return
    target = cache_file(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        temporary = target.with_name(f".{target.name}.{os.getpid()}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(document, handle, sort_keys=True)
        os.replace(temporary, target)
    except OSError:
        return
