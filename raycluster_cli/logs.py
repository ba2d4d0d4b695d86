"""`raycluster logs`: each node's container log and Ray session logs into DIR/<host>/, with an error count."""

from __future__ import annotations

import base64
import io
import re
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .containers import container_name
from .errors import OperationError
from .inventory import HostConfig, Inventory
from .transport import Transport, quote
from .transport.fanout import error_message, fanout
from .transport.pool import Connect

ERROR_LINE = re.compile(r"\bERROR\b|Traceback \(most recent call last\)|\bFATAL\b|\bCRITICAL\b|^\w*Error: ")
_SESSION_LOGS = "/tmp/ray/session_latest/logs"


@dataclass
class HostLogs:
    host: str
    folder: str
    files: int = 0
    bytes: int = 0
    error_lines: int = 0
    first_errors: list[str] = field(default_factory=list)
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "folder": self.folder,
            "files": self.files,
            "bytes": self.bytes,
            "error_lines": self.error_lines,
            "first_errors": self.first_errors,
            "error": self.error,
        }


def count_errors(text: str, limit: int = 3) -> tuple[int, list[str]]:
    """How many lines look like errors, and the first `limit` of them (pure)."""
    hits = [line.strip() for line in text.splitlines() if ERROR_LINE.search(line)]
    return len(hits), [h[:200] for h in hits[:limit]]


def collect(inventory: Inventory, connect: Connect, out_dir: Path, hosts: list[HostConfig]) -> list[HostLogs]:
    """Fetch every host's logs in parallel into out_dir/<address>/."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    found = fanout(
        hosts, lambda h: _collect_host(inventory, connect(h), h, out_dir / str(h.address)), what="collect the logs"
    )
    found.check_interrupted()
    for host, outcome in found:
        if outcome.value is not None:
            results.append(outcome.value)
        else:
            message = error_message(outcome.error or RuntimeError("no result"))
            results.append(HostLogs(str(host.address), str(out_dir / str(host.address)), error=message))
    return results


def _collect_host(inventory: Inventory, transport: Transport, host: HostConfig, folder: Path) -> HostLogs:
    name = quote(container_name(inventory, host))
    folder.mkdir(parents=True, exist_ok=True)
    logs = transport.run(f"docker logs {name} 2>&1", timeout=300)
    if not logs.ok:
        raise OperationError(f"{host.address}: no container log: {logs.first_line()}", "is the cluster up?")
    (folder / "container.log").write_text(logs.stdout)
    # docker cp works on a stopped container too; -L follows session_latest to the session's folder.
    session = transport.run(
        f't=$(mktemp) && {{ docker cp -L {name}:{_SESSION_LOGS} - > "$t" && gzip -1 -c "$t" | base64 -w0; '
        'r=$?; rm -f "$t"; exit $r; }',
        timeout=600,
    )
    files = [folder / "container.log"]
    if session.ok and session.stdout.strip():
        with tarfile.open(fileobj=io.BytesIO(base64.b64decode(session.stdout)), mode="r:gz") as archive:
            archive.extractall(folder / "ray", filter="data")
        files += sorted(p for p in (folder / "ray").rglob("*") if p.is_file())
    result = HostLogs(str(host.address), str(folder), len(files), sum(p.stat().st_size for p in files))
    for path in files:
        count, first = count_errors(path.read_text(errors="replace"))
        result.error_lines += count
        room = 3 - len(result.first_errors)
        result.first_errors += [f"{path.relative_to(folder)}: {line}" for line in first[:room]]
    if not session.ok:
        result.error = f"no Ray session logs: {session.first_line()}"
    return result
