"""This machine's state for each cluster and for the lab: where it lives, the cluster's Ray token, its lock.

Everything under one root: `$RAYCLUSTER_STATE_DIR`, else `$XDG_STATE_HOME/raycluster`, else
`~/.local/state/raycluster`; a folder per cluster (token, image archives, lock) and `lab/` for the local lab.
The folders are 0700 (an existing folder's mode is fixed); the token is written whole or not at all (temp
file, fsync, link into place) and checked whenever it is read, so an empty or cut token never reaches a host.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from raycluster_cli import cancel
from raycluster_cli.config.inventory import Inventory
from raycluster_cli.config.paths import state_root
from raycluster_cli.errors import OperationError
from raycluster_cli.progress import Progress, quiet

TOKEN_PATTERN = re.compile(r"[A-Za-z0-9._~+/=-]{32,1024}", re.ASCII)
LOCK_WAIT_S = 10.0
_LOCK_NAME = "lock"


def state_dir(inventory: Inventory) -> Path:
    """This cluster's folder on the operator machine."""
    return state_root() / inventory.cluster


def token_file(inventory: Inventory) -> Path:
    return state_dir(inventory) / "auth-token"


def ensure_private_dir(path: Path) -> Path:
    """`path` (and the state root above it) as folders of mode 0700; an existing one's mode is fixed."""
    root = state_root()
    for folder in (root, path) if root in path.parents else (path,):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if folder.stat().st_mode & 0o777 != 0o700:
            try:
                folder.chmod(0o700)
            except OSError as exc:
                raise OperationError(
                    f"{folder} is mode {folder.stat().st_mode & 0o777:o} and cannot be made 0700: {exc.strerror}",
                    f"chmod 700 {folder} (it holds the cluster's Ray token)",
                ) from None
    return path


def ensure_token(inventory: Inventory) -> bytes:
    """The cluster's Ray auth token, made once on the operator machine (mode 0600), checked when read."""
    path = token_file(inventory)
    if not path.exists():
        _write_new_token(ensure_private_dir(path.parent), path)
    return read_token(path)


def read_token(path: Path) -> bytes:
    """The token in `path`, or an error naming the file and the fix (never an empty or cut token)."""
    try:
        token = path.read_bytes().strip()
    except OSError as exc:
        raise OperationError(f"cannot read the Ray token {path}: {exc.strerror}", f"check {path}") from None
    if not TOKEN_PATTERN.fullmatch(token.decode("ascii", errors="replace")):
        state = "empty" if not token else f"malformed ({len(token)} bytes, not 32-1024 token characters)"
        raise OperationError(
            f"the Ray token file {path} is {state}: it is not put on any host",
            f"remove it (rm {path}) and re-run `raycluster up`: a new token is made and the containers are "
            "replaced to use it",
        )
    return token


def _write_new_token(folder: Path, path: Path) -> None:
    """Temp file, fsync, then link into place: readers see no token or a whole one; a racing writer's wins."""
    temp = folder / f".auth-token.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_hex(32).encode())
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):  # another process made it first: use theirs
            os.link(temp, path)
        _fsync_dir(folder)
    except OSError as exc:
        raise OperationError(
            f"cannot write the Ray token in {folder}: {exc.strerror or exc}",
            f"free space or fix permissions there (df -h {folder}); nothing was written",
        ) from None
    finally:
        temp.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ClusterBusy(OperationError):
    """Another raycluster process holds this cluster's lock."""


@contextlib.contextmanager
def cluster_lock(
    inventory: Inventory, verb: str, wait_s: float | None = None, progress: Progress = quiet
) -> Iterator[None]:
    """Hold this cluster's lock (fcntl.flock on `<state dir>/lock`) for one `up`/`down`.

    Another holder: wait up to `wait_s`, then refuse naming it (verb, pid, host, since when). The lock goes
    with the process (the kernel drops it when the file is closed or the process dies).
    """
    path = ensure_private_dir(state_dir(inventory)) / _LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _acquire(fd, path, inventory, LOCK_WAIT_S if wait_s is None else wait_s, progress)
        holder = {"verb": verb, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        holder["argv"] = " ".join(["raycluster", *sys.argv[1:]])[:200]
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        yield
    finally:
        os.close(fd)


def _acquire(fd: int, path: Path, inventory: Inventory, wait_s: float, progress: Progress) -> None:
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        who = describe_holder(path)
        if time.monotonic() >= deadline:
            raise ClusterBusy(
                f"cluster {inventory.cluster} is busy: {who} holds {path}",
                "wait until it ends and re-run; if it hangs, stop it (Ctrl-C there, or kill its pid)",
            )
        if not told:
            progress(f"cluster {inventory.cluster} is busy ({who}); waiting up to {wait_s:.0f}s")
            told = True
        cancel.check("waiting for the cluster lock")
        time.sleep(0.2)


def describe_holder(path: Path) -> str:
    """Who holds the lock, as its file says: '`raycluster up` (pid 42 on host, since 17:02:03)'."""
    try:
        holder = json.loads(path.read_text() or "{}")
        since = time.strftime("%H:%M:%S", time.localtime(float(holder["since"])))
        return f"`raycluster {holder['verb']}` (pid {holder['pid']} on {holder['host']}, since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another raycluster process"


def purge_local(inventory: Inventory) -> Path | None:
    """Remove this cluster's state (token, archives), but not the lock file a running verb holds."""
    folder = state_dir(inventory)
    if not folder.exists():
        return None
    for entry in folder.iterdir():
        if entry.name == _LOCK_NAME:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    with contextlib.suppress(OSError):  # not empty: the lock file of the running verb stays
        folder.rmdir()
    return folder
