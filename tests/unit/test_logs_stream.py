"""`logs` streams to disk under a per-host cap: the commands run by this machine's /bin/sh with a stand-in
`docker` (logs from a file, cp from a folder), through a transport that streams their output in chunks as
the SSH one does. The container log's tail is kept and its full size reported; Ray's session logs get what
is left of the cap; a log far larger than the cap never sits in this process's memory."""

from __future__ import annotations

import gzip
import io
import os
import selectors
import subprocess
import tarfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from raycluster_cli.config import inventory
from raycluster_cli.transport.base import CommandResult
from raycluster_cli.verbs.logs import MIB, CappedFile, Limits, collect, count_errors, count_errors_in

from .conftest import EXAMPLE

INV = inventory.parse(EXAMPLE)
HEAD = INV.head_host

FAKE_DOCKER = """#!/bin/sh
# a stand-in engine: `docker logs NAME` prints $FAKE/container.log, `docker cp -L NAME:DIR -` tars $FAKE/session
case "$1" in
  inspect) [ -e "$FAKE/container.log" ] && echo sha256:1 && exit 0; echo "Error: No such object: x" >&2; exit 1;;
  logs) cat "$FAKE/container.log";;
  cp) [ -d "$FAKE/session/logs" ] || { echo "Error: Could not find the file" >&2; exit 1; }
      tar -C "$FAKE/session" -cf - logs;;
  *) exit 125;;
esac
"""


class LocalStreaming:
    """Runs commands with this machine's sh; `stream` hands stdout/stderr over in chunks as they come."""

    def __init__(self, host: str, env: dict[str, str]) -> None:
        self.host, self.env = host, env
        self.largest_chunk = 0

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = 120.0) -> CommandResult:
        done = subprocess.run(["sh", "-c", command], capture_output=True, env=self.env, timeout=timeout)
        return CommandResult(done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode())

    def stream(self, command: str, on_output: Callable[[str, bytes], None], *, timeout: float | None = None) -> int:
        process = subprocess.Popen(["sh", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env)
        assert process.stdout is not None and process.stderr is not None
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ, "stdout")
        selector.register(process.stderr, selectors.EVENT_READ, "stderr")
        deadline = time.monotonic() + (timeout or 60)
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.2):
                data = os.read(key.fd, 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                self.largest_chunk = max(self.largest_chunk, len(data))
                on_output(key.data, data)
        return process.wait(timeout=10)

    def put(self, data: bytes, path: str, mode: int = 0o600) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


@pytest.fixture
def host_files(tmp_path: Path) -> tuple[Path, LocalStreaming]:
    fake = tmp_path / "host"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "docker").write_text(FAKE_DOCKER)
    (fake / "bin" / "docker").chmod(0o755)
    env = dict(os.environ, FAKE=str(fake), PATH=f"{fake / 'bin'}:{os.environ['PATH']}")
    return fake, LocalStreaming(str(HEAD.address), env)


def _session(fake: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = fake / "session" / "logs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _log(size: int) -> bytes:
    line = b"2026-11-30 12:00:00 INFO a line of the node's log that goes on for a while ......\n"
    body = line * (size // len(line) + 1)
    return (b"ERROR: early trouble\n" + body)[: size - 21] + b"\nERROR: the last one\n"


def test_a_small_log_is_fetched_whole_with_the_session_logs(
    host_files: tuple[Path, LocalStreaming], tmp_path: Path
) -> None:
    fake, transport = host_files
    (fake / "container.log").write_bytes(b"started\nTraceback (most recent call last):\nbye\n")
    _session(fake, {"raylet.out": b"ok\nERROR lost a worker\n", "gcs_server.out": b"fine\n"})
    [result] = collect(INV, lambda h: transport, tmp_path / "out", [HEAD])
    folder = Path(result.folder)
    assert (folder / "container.log").read_bytes() == (fake / "container.log").read_bytes()
    assert (folder / "ray" / "logs" / "raylet.out").read_bytes() == b"ok\nERROR lost a worker\n"
    assert (result.files, result.error_lines, result.error, result.truncated) == (3, 2, "", [])
    assert result.container_log_bytes == len((fake / "container.log").read_bytes())
    assert not list(folder.glob("*.partial"))


def test_the_container_logs_tail_is_kept_and_its_size_reported(
    host_files: tuple[Path, LocalStreaming], tmp_path: Path
) -> None:
    fake, transport = host_files
    log = _log(6 * MIB)
    (fake / "container.log").write_bytes(log)
    _session(fake, {"raylet.out": b"x" * 1000})
    [result] = collect(INV, lambda h: transport, tmp_path / "out", [HEAD], Limits(max_bytes=MIB))
    kept = (Path(result.folder) / "container.log").read_bytes()
    assert kept == log[-MIB:]  # the newest MiB, byte for byte
    assert result.container_log_bytes == len(log) and result.cap_bytes == MIB
    assert result.truncated[0] == "container.log: the last 1.0 MiB of 6.0 MiB kept (--max-mib)"
    assert "ERROR: the last one" in result.first_errors[0] and result.error_lines == 1
    # nothing left for Ray's logs: said so, and nothing over the cap on disk
    assert "no room left" in result.truncated[1] and result.bytes == MIB


def test_the_session_logs_get_what_is_left_of_the_cap(host_files: tuple[Path, LocalStreaming], tmp_path: Path) -> None:
    fake, transport = host_files
    (fake / "container.log").write_bytes(b"a\n" * 1000)
    noise = os.urandom(600_000)  # does not compress: a file this size cannot fit in what is left
    _session(fake, {"a.log": b"small\n", "b.log": noise, "c.log": b"small too\n"})
    [result] = collect(INV, lambda h: transport, tmp_path / "out", [HEAD], Limits(max_bytes=400_000))
    names = sorted(p.name for p in (Path(result.folder) / "ray").rglob("*") if p.is_file())
    assert "b.log" not in names and result.bytes <= 400_000
    assert any(t.startswith("ray/:") and "(--max-mib)" in t for t in result.truncated), result.truncated


def test_no_container_is_one_error_naming_the_host(host_files: tuple[Path, LocalStreaming], tmp_path: Path) -> None:
    _, transport = host_files
    [result] = collect(INV, lambda h: transport, tmp_path / "out", [HEAD])
    assert result.error.startswith(f"{HEAD.address}: no container log: Error: No such object")


def test_no_session_logs_is_reported(host_files: tuple[Path, LocalStreaming], tmp_path: Path) -> None:
    fake, transport = host_files
    (fake / "container.log").write_bytes(b"hello\n")
    [result] = collect(INV, lambda h: transport, tmp_path / "out", [HEAD])
    assert result.error.startswith("no Ray session logs: Error: Could not find the file"), result.error
    assert result.files == 1


def test_a_log_far_larger_than_memory_use_streams_to_disk(
    host_files: tuple[Path, LocalStreaming], tmp_path: Path
) -> None:
    """A 64 MiB log with a cap above it arrives whole, yet this process never allocates more than a few
    chunks' worth (Python allocations traced; the old code held the log twice, as bytes and as text)."""
    fake, transport = host_files
    log = _log(64 * MIB)
    (fake / "container.log").write_bytes(log)
    del log
    _session(fake, {"raylet.out": b"ok\n"})
    tracemalloc.start()
    try:
        [result] = collect(INV, lambda h: transport, tmp_path / "out", [HEAD], Limits(max_bytes=128 * MIB))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.container_log_bytes == 64 * MIB and result.truncated == [] and result.error == ""
    assert (Path(result.folder) / "container.log").stat().st_size == 64 * MIB
    assert peak < 4 * MIB, f"peak Python allocation {peak / MIB:.1f} MiB while streaming a 64 MiB log"


def test_the_sink_writes_at_most_the_cap_and_keeps_a_little_stderr(tmp_path: Path) -> None:
    with (tmp_path / "f").open("wb") as handle:
        sink = CappedFile(handle, 10)
        sink("stdout", b"0123456")
        sink("stdout", b"789abc")
        sink("stderr", b"e" * 10_000)
    assert (tmp_path / "f").read_bytes() == b"0123456789" and sink.received == 13 and len(sink.stderr) == 4096


def test_error_lines_are_counted_line_by_line_as_in_text(tmp_path: Path) -> None:
    text = "ok\nERROR one\nTraceback (most recent call last):\n" + "x" * 200_000 + " FATAL\nValueError: two\n"
    (tmp_path / "log").write_text(text)
    count, first = count_errors_in(tmp_path / "log")
    assert (count, first) == (4, count_errors(text)[1]) and count_errors(text)[0] == 4


def test_a_cut_archive_keeps_the_files_before_the_cut(tmp_path: Path) -> None:
    from raycluster_cli.verbs.logs import _extract

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in (("logs/a", b"a" * 5000), ("logs/b", os.urandom(50_000))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive = tmp_path / "x.tar.gz"
    archive.write_bytes(gzip.compress(raw.getvalue())[:30_000])
    files, skipped, whole = _extract(archive, tmp_path / "ray", 1_000_000)
    assert [p.name for p in files] == ["a"] and not whole and skipped == 0


def test_the_logs_folders_are_private(host_files: tuple[Path, LocalStreaming], tmp_path: Path) -> None:
    """Hosts' logs are for the operator: the folder and each host's folder are 0700, whatever the umask allows;
    a host's folder left 0755 by an earlier run is made private again."""
    fake, transport = host_files
    (fake / "container.log").write_bytes(b"started\n")
    _session(fake, {"raylet.out": b"ok\n"})
    out = tmp_path / "out"
    (out / str(HEAD.address)).mkdir(parents=True, mode=0o755)
    out.chmod(0o755)
    previous = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh"
        collect(INV, lambda h: transport, fresh, [HEAD])
        collect(INV, lambda h: transport, out, [HEAD])
    finally:
        os.umask(previous)
    assert (fresh.stat().st_mode & 0o777, (fresh / str(HEAD.address)).stat().st_mode & 0o777) == (0o700, 0o700)
    assert (out / str(HEAD.address)).stat().st_mode & 0o777 == 0o700
