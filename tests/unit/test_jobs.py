"""submit's pieces without a cluster: the working-dir package, the token, the exit code, log following."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.errors import OperationError, UsageError
from raycluster_cli.transport.websocket import Silence
from raycluster_cli.verbs.jobs import JobResult, TailUnavailable, follow_job, package_directory, read_token, submit_job

from .conftest import EXAMPLE

INV = inventory.parse(EXAMPLE)


def test_package_is_named_by_content_and_skips_caches(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("print(1)\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("X = 1\n")
    for skipped in (".git", "__pycache__"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "junk").write_text("junk")
    name, data = package_directory(tmp_path)
    assert name.startswith("_ray_pkg_") and name.endswith(".zip")
    assert sorted(zipfile.ZipFile(io.BytesIO(data)).namelist()) == ["job.py", "pkg/mod.py"]
    assert package_directory(tmp_path)[0] == name  # same content, same name (the dashboard keeps it once)
    (tmp_path / "job.py").write_text("print(2)\n")
    assert package_directory(tmp_path)[0] != name


def test_a_working_dir_that_is_not_a_folder_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a directory"):
        package_directory(tmp_path / "nope")


def test_token_comes_from_the_state_dir_and_its_absence_says_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAYCLUSTER_STATE_DIR", str(tmp_path))
    with pytest.raises(OperationError, match="no Ray token") as info:
        read_token(INV)
    assert "raycluster up" in info.value.hint
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "auth-token").write_text("abc\n")
    assert read_token(INV) == "abc"
    assert read_token(inventory.parse(EXAMPLE + "ray: {auth: none}\n")) is None


@pytest.mark.parametrize(
    ("status", "driver", "waited", "code"),
    [("SUCCEEDED", 0, True, 0), ("FAILED", 7, True, 7), ("FAILED", None, True, 1), ("STOPPED", None, True, 1),
     ("PENDING", None, False, 0)],
)  # fmt: skip
def test_exit_code_of_a_job(status: str, driver: int | None, waited: bool, code: int) -> None:
    assert JobResult("j", status, driver, waited=waited).code == code


class FakeDashboard:
    """Answers the dashboard's routes from a script of job states; records every request."""

    def __init__(self, states: list[tuple[str, str]]) -> None:
        self.states = states
        self.calls: list[tuple[str, str, Any]] = []
        self.packages: set[str] = set()

    def tail(self, path: str) -> Any:
        raise TailUnavailable("HTTP 404 Not Found")  # a dashboard without the tail

    def request(self, method: str, path: str, body: bytes | None = None, kind: str = "") -> Any:
        self.calls.append((method, path, body))
        if path.startswith("/api/packages/"):
            if method == "GET" and path.rsplit("/", 1)[1] not in self.packages:
                raise OperationError("GET: HTTP 404", "")
            self.packages.add(path.rsplit("/", 1)[1])
            return ""
        if method == "POST":
            return {"submission_id": json.loads(body or b"{}")["submission_id"]}
        if path.endswith("/logs"):
            logs = self.states[0][1]
            if len(self.states) > 1:
                self.states.pop(0)
            return {"logs": logs}
        status = self.states[0][0]
        return {"status": status, "driver_exit_code": 3 if status == "FAILED" else None, "message": "m"}


def test_submit_uploads_a_package_once_and_sends_the_quoted_entrypoint(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text("print(1)\n")
    dashboard = FakeDashboard([])
    job = submit_job(dashboard, ["python", "-c", "print('a b')"], working_dir=tmp_path, submission_id="s1")  # type: ignore[arg-type]
    submit_job(dashboard, ["python", "job.py"], working_dir=tmp_path)  # type: ignore[arg-type]
    puts = [c for c in dashboard.calls if c[0] == "PUT"]
    assert len(puts) == 1 and puts[0][1] == f"/api/packages/gcs/{job.package}"
    payload = json.loads(next(c[2] for c in dashboard.calls if c[0] == "POST"))
    assert payload["entrypoint"] == "python -c 'print('\"'\"'a b'\"'\"')'"
    assert payload["runtime_env"] == {"working_dir": f"gcs://{job.package}"} and payload["submission_id"] == "s1"


def test_without_a_tail_follow_polls_the_whole_log_and_hands_over_each_new_piece() -> None:
    dashboard = FakeDashboard([("RUNNING", "a\n"), ("RUNNING", "a\nb\n"), ("FAILED", "a\nb\nc\n")])
    pieces: list[str] = []
    job = follow_job(dashboard, JobResult("s1", "PENDING"), pieces.append, poll_s=0)  # type: ignore[arg-type]
    assert pieces == ["a\n", "b\n", "c\n"]
    assert (job.status, job.exit_code, job.code, job.logs_bytes, job.logs_via) == ("FAILED", 3, 3, 6, "poll")


class FakeTail:
    """One tail connection: a script of pieces, then Silence, a drop (ConnectionError) or the server's close."""

    def __init__(self, script: list[str | type[Exception]]) -> None:
        self.script = script
        self.closed = False

    def messages(self) -> Any:
        while self.script:
            item = self.script.pop(0)
            if isinstance(item, str):
                yield item
            else:
                raise item()

    def close(self) -> None:
        self.closed = True


class TailingDashboard(FakeDashboard):
    """Statuses in order (one per status request), tails in order (one per connection)."""

    def __init__(self, statuses: list[str], tails: list[FakeTail], logs: str = "") -> None:
        super().__init__([(statuses[0], logs)])
        self.statuses, self.tails, self.opened = statuses, tails, 0

    def tail(self, path: str) -> Any:
        assert path == "/api/jobs/s1/logs/tail"
        self.opened += 1
        return self.tails.pop(0)

    def request(self, method: str, path: str, body: bytes | None = None, kind: str = "") -> Any:
        if path == "/api/jobs/s1":
            self.calls.append((method, path, body))
            status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
            return {"status": status, "driver_exit_code": 0, "message": ""}
        return super().request(method, path, body, kind)


def test_follow_reads_the_tail_once_and_never_fetches_the_whole_log() -> None:
    tail = FakeTail(["a\n", "b\n", Silence, "c\n"])  # a silent stretch in the middle, then the server closes
    dashboard = TailingDashboard(["RUNNING", "SUCCEEDED"], [tail])
    pieces: list[str] = []
    job = follow_job(dashboard, JobResult("s1", "PENDING"), pieces.append, poll_s=0)  # type: ignore[arg-type]
    assert pieces == ["a\n", "b\n", "c\n"] and tail.closed
    assert (job.status, job.logs_bytes, job.logs_via) == ("SUCCEEDED", 6, "tail")
    assert not [c for c in dashboard.calls if c[1].endswith("/logs")]  # the whole log: never asked for


def test_a_tail_that_drops_while_the_job_runs_is_reopened_and_the_replay_skipped() -> None:
    first = FakeTail(["a\n", "b", ConnectionError])  # a half line, then the tunnel drops
    again = FakeTail(["a\nb\n", "c\n"])  # Ray replays the log from its start
    dashboard = TailingDashboard(["RUNNING", "SUCCEEDED"], [first, again])
    pieces: list[str] = []
    job = follow_job(dashboard, JobResult("s1", "PENDING"), pieces.append, poll_s=0)  # type: ignore[arg-type]
    assert "".join(pieces) == "a\nb\nc\n" and pieces == ["a\n", "b", "\n", "c\n"]
    assert dashboard.opened == 2 and job.logs_bytes == 6


def test_a_tail_silent_after_the_jobs_end_gives_up_and_catches_up_from_the_whole_log() -> None:
    tail = FakeTail(["a\n", Silence, Silence, Silence])
    dashboard = TailingDashboard(["SUCCEEDED"], [tail], logs="a\nlast words\n")
    pieces: list[str] = []
    job = follow_job(dashboard, JobResult("s1", "PENDING"), pieces.append, poll_s=0)  # type: ignore[arg-type]
    assert pieces == ["a\n", "last words\n"] and job.logs_bytes == len("a\nlast words\n")
