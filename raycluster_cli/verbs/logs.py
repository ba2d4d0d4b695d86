"""`raycluster logs`: each node's container log and Ray session logs into DIR/<host>/, with an error count.

Both streams go to disk as they arrive (nothing holds a whole log in memory) and are capped per host
(`max_bytes`): the container log keeps its *tail* (the newest lines: `tail -c` on the host, so only the
kept bytes cross the network; the log's full size is reported), and the Ray session logs get what is
left of the cap — the archive is cut there on the host and files that do not fit are skipped (counted).
Each stream runs under a deadline (`timeout_s`), over a connection whose keepalive drops a silent host,
and through the remote guard like every other command.
"""

from __future__ import annotations

import re
import tarfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from raycluster_cli.config.defaults import DEFAULT_MAX_MIB, DEFAULT_TIMEOUT_S
from raycluster_cli.config.inventory import HostConfig, Inventory
from raycluster_cli.errors import OperationError
from raycluster_cli.host.containers import container_name
from raycluster_cli.host.engine import dialect_for
from raycluster_cli.transport import Transport, quote
from raycluster_cli.transport.fanout import error_message, fanout
from raycluster_cli.transport.pool import Connect

ERROR_LINE = re.compile(r"\bERROR\b|Traceback \(most recent call last\)|\bFATAL\b|\bCRITICAL\b|^\w*Error: ")
_SESSION_LOGS = "/tmp/ray/session_latest/logs"
MIB = 1024 * 1024
_LINE_LIMIT = 64 * 1024  # an error line is judged on its first 64 KiB (a line without newlines stays bounded)
PRIVATE_DIR = 0o700  # the logs folders: hosts' logs are for the operator alone


@dataclass(frozen=True)
class Limits:
    max_bytes: int = DEFAULT_MAX_MIB * MIB  # per host, on disk
    timeout_s: float = DEFAULT_TIMEOUT_S  # per stream


@dataclass
class HostLogs:
    host: str
    folder: str
    files: int = 0
    bytes: int = 0
    error_lines: int = 0
    first_errors: list[str] = field(default_factory=list)
    error: str = ""
    container_log_bytes: int = 0  # the container log's size on the host
    cap_bytes: int = 0
    truncated: list[str] = field(default_factory=list)  # what the cap cut, in words

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def count_errors(text: str, limit: int = 3) -> tuple[int, list[str]]:
    """How many lines look like errors, and the first `limit` of them (pure)."""
    hits = [line.strip() for line in text.splitlines() if ERROR_LINE.search(line)]
    return len(hits), [h[:200] for h in hits[:limit]]


def count_errors_in(path: Path, limit: int = 3) -> tuple[int, list[str]]:
    """count_errors over a file, read line by line (a file of any size in bounded memory)."""
    count, first = 0, list[str]()
    with path.open(errors="replace") as handle:
        for line in iter(lambda: handle.readline(_LINE_LIMIT), ""):
            if ERROR_LINE.search(line):
                count += 1
                if len(first) < limit:
                    first.append(line.strip()[:200])
    return count, first


def collect(
    inventory: Inventory, connect: Connect, out_dir: Path, hosts: list[HostConfig], limits: Limits | None = None
) -> list[HostLogs]:
    """Fetch every host's logs in parallel into out_dir/<address>/.

    The folders are made 0700: hosts' logs name users, addresses and paths, and the operator's machine may be
    shared. A folder `--out` names that already exists keeps its mode; each host's folder is made private."""
    out_dir.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    chosen = limits or Limits()
    results = []
    found = fanout(
        hosts,
        lambda h: _collect_host(inventory, connect(h), h, out_dir / str(h.address), chosen),
        what="collect the logs",
    )
    found.check_interrupted()
    for host, outcome in found:
        if outcome.value is not None:
            results.append(outcome.value)
        else:
            message = error_message(outcome.error or RuntimeError("no result"))
            results.append(HostLogs(str(host.address), str(out_dir / str(host.address)), error=message))
    return results


class CappedFile:
    """An output sink that writes stdout to a file up to `cap` bytes and keeps the first 4 KiB of stderr."""

    def __init__(self, handle: BinaryIO, cap: int) -> None:
        self.handle, self.cap = handle, cap
        self.written = 0
        self.received = 0
        self.stderr = bytearray()

    def __call__(self, stream: str, data: bytes) -> None:
        if stream != "stdout":
            self.stderr += data[: max(0, 4096 - len(self.stderr))]
            return
        self.received += len(data)
        room = self.cap - self.written
        if room > 0:
            self.handle.write(data[:room])
            self.written += min(room, len(data))


def container_log_command(name: str, cap: int) -> str:
    """The container log's last `cap` bytes on stdout and its full size on stderr (the host keeps at most
    `cap` bytes in `tail`'s buffer; a fifo feeds `wc` a copy of the stream)."""
    return (
        'f=$(mktemp -u /tmp/.raycluster-logs.XXXXXX) && mkfifo -m 600 "$f" || exit 1; '
        f'wc -c <"$f" >&2 & docker logs {quote(name)} 2>&1 | tee "$f" | tail -c {int(cap)}; '
        'wait; rm -f "$f"'
    )


def session_logs_command(name: str, cap: int, copy: str = "cp -L") -> str:
    """The Ray session logs as a gzip'd tar, cut at `cap` bytes on the host (docker cp works on a stopped
    container too; `copy` follows session_latest to the session's folder: Docker's `cp -L`, Podman's `cp`)."""
    return f"docker {copy} {quote(name)}:{_SESSION_LOGS} - | gzip -1 -c | head -c {int(cap)}"


def _stream_to(transport: Transport, command: str, path: Path, cap: int, timeout: float) -> tuple[int, CappedFile]:
    """Run `command` with its stdout streamed into `path` (at most `cap` bytes): exit status and the sink."""
    stream: Callable[..., int] | None = getattr(transport, "stream", None)
    with path.open("wb") as handle:
        sink = CappedFile(handle, cap)
        if stream is not None:
            rc = stream(command, sink, timeout=timeout)
        else:  # a transport without streaming (the unit tests' fake): the whole output, then the same sink
            done = transport.run(command, timeout=timeout)
            sink("stdout", done.stdout.encode("latin-1", errors="replace"))
            sink("stderr", done.stderr.encode())
            rc = done.rc
    return rc, sink


def _collect_host(
    inventory: Inventory, transport: Transport, host: HostConfig, folder: Path, limits: Limits
) -> HostLogs:
    name = container_name(inventory, host)
    folder.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    folder.chmod(PRIVATE_DIR)  # a folder a run before this one made keeps no wider mode
    found = transport.run(f"docker inspect --format '{{{{.Id}}}}' {quote(name)}", timeout=60)
    if not found.ok:
        raise OperationError(f"{host.address}: no container log: {found.first_line()}", "is the cluster up?")
    result = HostLogs(str(host.address), str(folder), cap_bytes=limits.max_bytes)
    log_path = folder / "container.log"
    rc, sink = _stream_to(transport, container_log_command(name, limits.max_bytes), log_path, limits.max_bytes,
                          limits.timeout_s)  # fmt: skip
    total = _last_number(sink.stderr.decode(errors="replace"))
    result.container_log_bytes = total if total is not None else sink.received
    if rc != 0:
        raise OperationError(f"{host.address}: no container log: exit status {rc}", "is the cluster up?")
    if result.container_log_bytes > sink.written:
        result.truncated.append(
            f"container.log: the last {_mib(sink.written)} of {_mib(result.container_log_bytes)} kept (--max-mib)"
        )
    files = [log_path]
    copy = dialect_for(inventory, host).copy_out
    files += _session_logs(transport, name, folder, limits.max_bytes - sink.written, limits.timeout_s, result, copy)
    result.files, result.bytes = len(files), sum(p.stat().st_size for p in files)
    for path in files:
        count, first = count_errors_in(path)
        result.error_lines += count
        room = 3 - len(result.first_errors)
        result.first_errors += [f"{path.relative_to(folder)}: {line}" for line in first[:room]]
    return result


def _session_logs(
    transport: Transport, name: str, folder: Path, budget: int, timeout: float, result: HostLogs, copy: str
) -> list[Path]:
    """The Ray session logs extracted into folder/ray/ within `budget` bytes (archive and files)."""
    if budget <= 0:
        result.truncated.append("ray/: no room left under the cap (--max-mib) after container.log")
        return []
    archive = folder / "ray-logs.tar.gz.partial"
    try:
        _, sink = _stream_to(transport, session_logs_command(name, budget, copy), archive, budget, timeout)
        cut = sink.received >= budget
        extracted, skipped, complete = _extract(archive, folder / "ray", budget)
    finally:
        archive.unlink(missing_ok=True)
    if not extracted and not complete:
        said = sink.stderr.decode(errors="replace").strip().splitlines()
        result.error = "no Ray session logs: " + (said[0][:200] if said else "the container has none")
    if cut or skipped or not complete:
        result.truncated.append(
            f"ray/: {len(extracted)} file(s) kept, {skipped} skipped"
            + (", the archive cut" if cut or not complete else "")
            + f" at {_mib(budget)} (--max-mib)"
        )
    return extracted


def _extract(archive: Path, into: Path, budget: int) -> tuple[list[Path], int, bool]:
    """Extract regular files while they fit in `budget` bytes; (files, how many skipped, archive whole)."""
    files: list[Path] = []
    skipped, used = 0, 0
    try:
        with tarfile.open(archive, mode="r|gz") as tar:
            for member in tar:
                if not member.isfile():
                    if member.isdir():
                        tar.extract(member, into, filter="data")
                    continue
                if used + member.size > budget:
                    skipped += 1
                    continue
                tar.extract(member, into, filter="data")
                used += member.size
                files.append(into / member.name)
    except (tarfile.TarError, EOFError, zlib.error, OSError):
        return sorted(p for p in files if p.is_file()), skipped, False
    return sorted(p for p in files if p.is_file()), skipped, True


def _last_number(text: str) -> int | None:
    for line in reversed(text.strip().splitlines()):
        if line.strip().isdigit():
            return int(line.strip())
    return None


def _mib(size: int) -> str:
    return f"{size / MIB:.1f} MiB"
