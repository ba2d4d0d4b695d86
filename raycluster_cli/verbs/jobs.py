"""`raycluster submit` and `dashboard`: Ray's dashboard (jobs REST API) through a tunnel over SSH.

Why the REST API and not Ray's job SDK: the operator install need not have Ray (and a Ray client of another
version than the cluster's is refused by the SDK's version check); the REST API is the interface the SDK
itself speaks (`/api/packages/…`, `/api/jobs/…`), so one code path serves every operator machine, with the
standard library only. The cluster's token goes only into the `Authorization` header of requests that
travel inside the SSH connection; it is never printed nor put on a command line.

A job's log is followed as the SDK's `tail_job_logs` does, over the dashboard's WebSocket
(`/api/jobs/<id>/logs/tail`, websocket.py): each piece of the log crosses the tunnel once. The REST route
returns the whole log on each call, so it serves only a dashboard without the tail (polled then), and a
catch-up after a tail that ended early.
"""

from __future__ import annotations

import hashlib
import http.client
import io
import json
import secrets
import shlex
import socket
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raycluster_cli.config.inventory import Inventory
from raycluster_cli.config.state import token_file
from raycluster_cli.errors import OperationError, UsageError
from raycluster_cli.transport.pool import Connect
from raycluster_cli.transport.tunnel import Tunnel, forward_opener
from raycluster_cli.transport.websocket import HandshakeRefused, ProtocolError, Silence, WebSocket

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
MAX_PACKAGE_BYTES = 100 * 1024 * 1024  # Ray's own limit for a working_dir is larger; beyond this, use a volume
_SKIP_DIRS = {".git", "__pycache__", ".venv", ".mypy_cache", ".pytest_cache"}


def read_token(inventory: Inventory) -> str | None:
    """The cluster's Ray token from this machine's state dir (None when the cluster runs without auth)."""
    if inventory.ray.auth == "none":
        return None
    path = token_file(inventory)
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        raise OperationError(
            f"no Ray token for cluster {inventory.cluster} at {path}",
            "run `raycluster up` from this machine (it makes the token), or copy the file here (mode 0600)",
        ) from None
    if not token:
        raise OperationError(f"the Ray token file {path} is empty", "run `raycluster up` to write it again")
    return token


@contextmanager
def dashboard_tunnel(
    inventory: Inventory, connect: Connect, local_port: int = 0, token: bool = True
) -> Iterator[tuple[Tunnel, str | None]]:
    """127.0.0.1:`local_port` → the head's dashboard through the head's SSH connection, with the cluster's
    token (read first, so that a missing token fails before any connection)."""
    secret = read_token(inventory) if token else None
    head = inventory.head_host
    dest = (inventory.head_address, inventory.ray.dashboard_port)
    with Tunnel(forward_opener(connect(head), str(head.address), dest), local_port) as tunnel:
        yield tunnel, secret


class Dashboard:
    """A small HTTP client for the dashboard's REST API (token in the Authorization header)."""

    def __init__(self, tunnel: Tunnel, token: str | None, timeout_s: float = 60.0, host: str = "") -> None:
        self.host = host  # the head host, named in errors
        self.tunnel = tunnel
        self.token = token
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: bytes | None = None, kind: str = "application/json") -> Any:
        headers = {"Content-Type": kind} if body is not None else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        connection = http.client.HTTPConnection("127.0.0.1", self.tunnel.port, timeout=self.timeout_s)
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            status, data = response.status, response.read()
        except (OSError, http.client.HTTPException) as exc:
            where = "; ".join(self.tunnel.errors[-1:]) or f"{type(exc).__name__}: {exc}"
            raise OperationError(f"the dashboard did not answer {method} {path}: {where}", _UP_HINT) from None
        finally:
            connection.close()
        if status in (401, 403):
            raise OperationError(
                f"the dashboard refused the cluster's token (HTTP {status})",
                "the token in this machine's state dir is not the cluster's: run `raycluster up` again",
            )
        if status >= 400:
            text = data.decode(errors="replace").strip().splitlines()
            raise OperationError(f"{method} {path}: HTTP {status}: {text[-1] if text else ''}"[:400], _UP_HINT)
        try:
            return json.loads(data) if data and data[:1] in (b"{", b"[") else data.decode(errors="replace")
        except ValueError:
            return data.decode(errors="replace")  # not JSON after all: callers that need an object say so

    def tail(self, path: str, silence_s: float = 5.0) -> WebSocket:
        """A WebSocket to `path` through the tunnel; each read waits at most `silence_s` (then Silence)."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            sock = socket.create_connection(("127.0.0.1", self.tunnel.port), timeout=self.timeout_s)
        except OSError as exc:
            raise TailUnavailable(f"{type(exc).__name__}: {exc}") from None
        try:
            ws = WebSocket.open(sock, f"127.0.0.1:{self.tunnel.port}", path, headers)
        except HandshakeRefused as exc:
            sock.close()
            if exc.status in (401, 403):
                raise OperationError(
                    f"the dashboard refused the cluster's token (HTTP {exc.status})", _UP_HINT
                ) from None
            raise TailUnavailable(str(exc)) from None
        except (OSError, ProtocolError, Silence) as exc:
            sock.close()
            raise TailUnavailable(f"{type(exc).__name__}: {exc}") from None
        sock.settimeout(silence_s)
        return ws


class TailUnavailable(Exception):
    """The dashboard offers no log tail (an older Ray, a proxy without WebSockets): poll the log instead."""


_UP_HINT = "is the cluster up? `raycluster status`"


def check_dashboard(dashboard: Dashboard) -> dict[str, Any]:
    """The dashboard's /api/version (proves the tunnel, the dashboard and the token)."""
    version = _object(dashboard, "GET", "/api/version")
    dashboard.request("GET", "/api/jobs/")  # a route that needs the token when auth is on
    return version


def package_directory(directory: Path) -> tuple[str, bytes]:
    """Zip `directory` (paths relative to it, as Ray's own packaging) and name it by its content hash.

    Skips .git, __pycache__, .venv and tool caches. Returns (package name, zip bytes)."""
    if not directory.is_dir():
        raise UsageError(f"--working-dir {directory} is not a directory", "pass the folder holding your script")
    buffer = io.BytesIO()
    files = sorted(
        p for p in directory.rglob("*") if p.is_file() and not _SKIP_DIRS & set(p.relative_to(directory).parts)
    )
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in files:
            info = zipfile.ZipInfo(str(path.relative_to(directory)), date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (path.stat().st_mode & 0o777) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
            if buffer.tell() > MAX_PACKAGE_BYTES:
                raise UsageError(
                    f"--working-dir {directory} is over {MAX_PACKAGE_BYTES // 2**20} MiB zipped",
                    "leave data out of it (read data from a path every node has)",
                )
    data = buffer.getvalue()
    return f"_ray_pkg_{hashlib.sha256(data).hexdigest()[:32]}.zip", data


@dataclass
class JobResult:
    submission_id: str
    status: str
    exit_code: int | None = None  # the driver's exit code, as Ray reports it
    message: str = ""
    logs_bytes: int = 0
    package: str = ""
    waited: bool = True
    version: dict[str, Any] = field(default_factory=dict)
    logs_via: str = ""  # "tail" (the dashboard's WebSocket) or "poll" (the whole log, each poll)

    @property
    def code(self) -> int:
        """The verb's exit code: 0 when accepted (--no-wait) or SUCCEEDED; the driver's exit code when it
        failed (1 when Ray knows none, e.g. the runtime env could not be set up, or the job was stopped)."""
        if not self.waited or self.status == "SUCCEEDED":
            return 0
        return self.exit_code if self.exit_code not in (None, 0) else 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "submission_id": self.submission_id,
            "status": self.status,
            "driver_exit_code": self.exit_code,
            "message": self.message,
            "logs_bytes": self.logs_bytes,
            "working_dir_package": self.package,
            "waited": self.waited,
            "logs_via": self.logs_via,
        }


def submit_job(
    dashboard: Dashboard,
    entrypoint: list[str],
    *,
    working_dir: Path | None = None,
    submission_id: str | None = None,
) -> JobResult:
    """Upload the working dir (unless the dashboard has it), then submit; return the accepted job."""
    if not entrypoint:
        raise UsageError("no entrypoint given", "put it after --, e.g. raycluster submit -- python script.py")
    runtime_env: dict[str, Any] = {}
    package = ""
    if working_dir is not None:
        package, data = package_directory(working_dir)
        try:
            dashboard.request("GET", f"/api/packages/gcs/{package}")
        except OperationError:
            dashboard.request("PUT", f"/api/packages/gcs/{package}", body=data, kind="application/octet-stream")
        runtime_env["working_dir"] = f"gcs://{package}"
    job_id = submission_id or f"raycluster_{time.strftime('%Y%m%d_%H%M%S')}_{secrets.token_hex(3)}"
    payload = {"entrypoint": shlex.join(entrypoint), "submission_id": job_id, "runtime_env": runtime_env}
    accepted = dashboard.request("POST", "/api/jobs/", body=json.dumps(payload).encode())
    sid = accepted.get("submission_id", job_id) if isinstance(accepted, dict) else job_id
    sid = sid if isinstance(sid, str) and sid else job_id
    return JobResult(sid, "PENDING", package=package)


def follow_job(dashboard: Dashboard, job: JobResult, on_logs: Callable[[str], None], poll_s: float = 1.0) -> JobResult:
    """Hand every new piece of the job's log to `on_logs` until the job ended and its log is read.

    The tail pushes each piece once and closes after the job's end. A tail that drops while the job runs is
    opened again; Ray replays the log from its start then, and what was handed over already is skipped."""
    seen = 0  # characters handed over
    while True:
        try:
            ws = dashboard.tail(f"/api/jobs/{job.submission_id}/logs/tail")
        except TailUnavailable:
            return _poll_logs(dashboard, job, on_logs, poll_s, seen)
        job.logs_via = "tail"
        try:
            closed, seen = _read_tail(dashboard, job, ws, on_logs, seen)
        finally:
            ws.close()
        _refresh(dashboard, job)
        if job.status in TERMINAL:
            if not closed or not seen:  # the tail gave up early, or ended before the driver started
                seen = _catch_up(dashboard, job, on_logs, seen)
            job.logs_bytes = seen
            return job
        time.sleep(poll_s)


def _read_tail(
    dashboard: Dashboard, job: JobResult, ws: WebSocket, on_logs: Callable[[str], None], seen: int
) -> tuple[bool, int]:
    """Read one tail connection: (whether the server closed it, characters handed over now)."""
    received = 0  # characters of this connection (a replay from the log's start)
    quiet_after_end = 0
    while True:
        try:
            for piece in ws.messages():
                start, received = received, received + len(piece)
                new = piece[max(0, seen - start) :]
                if new:
                    on_logs(new)
                    seen += len(new)
            return True, seen
        except Silence:
            _refresh(dashboard, job)  # a silent job, or a tail that missed the end: the status says which
            quiet_after_end = quiet_after_end + 1 if job.status in TERMINAL else 0
            if quiet_after_end >= 2:
                return False, seen
        except (OSError, ProtocolError):
            return False, seen


def _refresh(dashboard: Dashboard, job: JobResult) -> None:
    info = _object(dashboard, "GET", f"/api/jobs/{job.submission_id}")
    job.status = str(info.get("status", "?"))
    code = info.get("driver_exit_code")
    job.exit_code = code if isinstance(code, int) and not isinstance(code, bool) else None
    job.message = str(info.get("message") or "")


def _object(dashboard: Dashboard, method: str, path: str) -> dict[str, Any]:
    """The dashboard's answer to `method path`, which must be a JSON object (else an error naming the head)."""
    answer = dashboard.request(method, path)
    if not isinstance(answer, dict):
        where = getattr(dashboard, "host", "") or "the head"
        raise OperationError(
            f"{where}: the dashboard's answer to {method} {path} is not a JSON object: {str(answer)[:80]!r}",
            _UP_HINT,
        )
    return answer


def _catch_up(dashboard: Dashboard, job: JobResult, on_logs: Callable[[str], None], seen: int) -> int:
    logs = dashboard.request("GET", f"/api/jobs/{job.submission_id}/logs")
    text = logs.get("logs", "") if isinstance(logs, dict) else ""
    if len(text) > seen:
        on_logs(text[seen:])
        seen = len(text)
    return seen


def _poll_logs(
    dashboard: Dashboard, job: JobResult, on_logs: Callable[[str], None], poll_s: float, seen: int
) -> JobResult:
    """Poll the job's status and whole log until it ends (a dashboard without the tail)."""
    job.logs_via = "poll"
    while True:
        _refresh(dashboard, job)
        seen = _catch_up(dashboard, job, on_logs, seen)
        job.logs_bytes = seen
        if job.status in TERMINAL:
            return job
        time.sleep(poll_s)


def stop_hint(inventory: Inventory, submission_id: str) -> str:
    """How to stop a job that keeps running after Ctrl-C (token from the head container's own env)."""
    address = f"http://{inventory.head_address}:{inventory.ray.dashboard_port}"
    return f"raycluster exec -- ray job stop --address {shlex.quote(address)} {shlex.quote(submission_id)}"
