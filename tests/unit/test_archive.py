"""`docker save | compressor > file` fails whole, with the real cause, and leaves no partial file.

Real processes throughout (shell, gzip, head); the full disk is a real 1 MiB tmpfs in a private mount
namespace (skipped where this machine does not allow `unshare --mount`).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from raycluster_cli.delivery import deliver as images
from raycluster_cli.delivery.archive import PipelineError, Step, save_compressed

GZIP = Step(["gzip", "-1", "-c"], "gzip")


def _source(tmp_path: Path, size: int) -> Step:
    """A producer that records its pid, then writes `size` bytes."""
    script = f"echo $$ > {tmp_path}/source.pid; exec head -c {size} /dev/urandom"
    return Step(["sh", "-c", script], "docker save")


def _gone(tmp_path: Path) -> bool:
    pid = int((tmp_path / "source.pid").read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_whole_archive_is_renamed_into_place(tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    seen: list[int] = []
    copied = save_compressed(_source(tmp_path, 3_000_000), GZIP, dest, seen.append)
    assert copied == 3_000_000 and seen[-1] == copied
    assert len(gzip.decompress(dest.read_bytes())) == 3_000_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar.gz", "source.pid"]


def test_a_dead_compressor_stops_the_source_and_says_why(tmp_path: Path) -> None:
    dying = Step(["sh", "-c", "head -c 1000 >/dev/null; echo 'zstd: error 70 : Write error' >&2; exit 3"], "zstd")
    with pytest.raises(PipelineError) as info:
        save_compressed(_source(tmp_path, 200_000_000), dying, tmp_path / "a.tar.zst", what="the archive of img")
    error = info.value
    assert error.step == "zstd"
    assert (
        error.message == "writing the archive of img failed: zstd exited with status 3 (zstd: error 70 : Write error)"
    )
    assert "BrokenPipe" not in error.one_line()
    assert not list(tmp_path.glob("*.tar.*")), "the partial file is left"
    assert _gone(tmp_path), "docker save still runs"


def test_a_failing_source_is_named_with_its_words(tmp_path: Path) -> None:
    failing = Step(
        ["sh", "-c", "echo 'Error response from daemon: reference does not exist' >&2; exit 1"], "docker save"
    )
    with pytest.raises(PipelineError) as info:
        save_compressed(failing, GZIP, tmp_path / "a.tar.gz")
    assert info.value.step == "docker save"
    assert (
        "docker save exited with status 1 (Error response from daemon: reference does not exist)" in info.value.message
    )
    assert not list(tmp_path.iterdir())


def test_an_interrupt_stops_both_and_removes_the_partial_file(tmp_path: Path) -> None:
    def interrupt(copied: int) -> None:
        if copied > 2_000_000:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_compressed(_source(tmp_path, 200_000_000), GZIP, tmp_path / "a.tar.gz", interrupt)
    assert [p.name for p in tmp_path.iterdir()] == ["source.pid"]
    assert _gone(tmp_path)


_FULL_DISK = """
import json, sys
from pathlib import Path
from raycluster_cli.delivery.archive import PipelineError, Step, save_compressed
mount = Path(sys.argv[1])
source = Step(["sh", "-c", "head -c 50000000 /dev/urandom"], "docker save")
try:
    save_compressed(source, Step(["gzip", "-1", "-c"], "gzip"), mount / "a.tar.gz")
except PipelineError as exc:
    print(json.dumps({"message": exc.message, "hint": exc.hint, "step": exc.step,
                      "left": [p.name for p in mount.iterdir()]}))
"""


def test_a_full_disk_is_reported_as_such(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    mount = tmp_path / "small"
    mount.mkdir()
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unshare --mount is not allowed here: {probe.stderr.decode().strip()}")
    script = f'mount -t tmpfs -o size=1m tmpfs {mount} && exec "$0" -c "$1" {mount}'
    done = subprocess.run(
        ["unshare", "--mount", "sh", "-c", script, sys.executable, _FULL_DISK],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["step"] == "gzip"
    assert report["message"].startswith(
        f"writing the image archive failed: no space left on {mount} (gzip: stdout: No space left on device"
    )
    assert f"df -h {mount}" in report["hint"]
    assert report["left"] == []


def test_archive_reports_the_compressor_not_a_broken_pipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """images._archive with a real (fake) docker script and a compressor that dies."""
    docker = tmp_path / "docker"
    docker.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = image ]; then echo 100000000; exit 0; fi\n'
        f'if [ "$1" = save ]; then echo $$ > {tmp_path}/source.pid; exec head -c 100000000 /dev/urandom; fi\n'
        "exit 2\n"
    )
    docker.chmod(0o755)
    monkeypatch.setattr(images, "docker_here", lambda: str(docker))
    monkeypatch.setattr(images, "ensure_room", lambda *args: None)
    crash = ["sh", "-c", "head -c 10 >/dev/null; echo 'gzip: crashed' >&2; exit 9"]
    monkeypatch.setattr(images, "compressor", lambda codec: crash)
    archive_dir = tmp_path / "images"
    with pytest.raises(PipelineError) as info:
        images._archive("img:1", "sha256:" + "ab" * 32, "gzip", archive_dir, lambda *_: None)
    assert info.value.message == "writing the archive of img:1 failed: gzip exited with status 9 (gzip: crashed)"
    assert list(archive_dir.iterdir()) == []
    assert _gone(tmp_path)
