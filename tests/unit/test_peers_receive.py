"""The receiver's side of an image copy (peer_copy.receive_command) under a real bash, with real `tail`, `gzip`
and `timeout`, and a fake `docker` that records what it loads: the archive arrives on stdin, as the
operator's stream gives it (a peer's copy reaches the same pipeline through /dev/tcp). No connection is
opened."""

from __future__ import annotations

import gzip
import hashlib
import os
import select
import subprocess
from pathlib import Path
from typing import Any

import pytest

from raycluster_cli.image import peer_copy

# A `docker load` that reads nothing until the archive file has $SIZE bytes (at most 20 s), as a daemon
# committing a multi-GB layer stops reading for a while; it notes the file's size when it starts reading.
# With $PUBLISHED_WAIT (tenths of a second), it then waits that long at most for the archive to be published
# under its serving name, and notes whether it was, while the load still runs; then, with $HOLD, it reads
# nothing more until the file $D/go exists (at most 20 s).
FAKE_DOCKER = """#!/bin/sh
case "$1" in
load)
  i=0
  while [ "$(stat -c %s "$PART" 2>/dev/null || echo 0)" -lt "$SIZE" ] && [ "$i" -lt 200 ]; do
    sleep 0.1; i=$((i + 1))
  done
  stat -c %s "$PART" >"$D/part-at-load"
  i=0
  while [ ! "$PART" -ef "$ARCHIVE" ] && [ "$i" -lt "${PUBLISHED_WAIT:-0}" ]; do sleep 0.1; i=$((i + 1)); done
  if [ "$PART" -ef "$ARCHIVE" ]; then echo yes; else echo no; fi >"$D/published-while-loading"
  i=0
  while [ -n "$HOLD" ] && [ ! -e "$D/go" ] && [ "$i" -lt 200 ]; do sleep 0.1; i=$((i + 1)); done
  cat >"$D/loaded" && echo "Loaded image ID: sha256:abc" ;;
image) echo "sha256:abc" ;;
esac
"""


def _start(
    tmp_path: Path, wait_for: int, path: str = "", digest: str = "", published_wait: int = 0, hold: bool = False
) -> subprocess.Popen[bytes]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    archive = tmp_path / "images" / "a.tar.gz"
    command = peer_copy.receive_script(peer_copy.receive_command(str(archive), "gzip -dc", "img:1", "", digest))
    env = {
        "PATH": f"{path}{bin_dir}:/usr/bin:/bin",
        "D": str(tmp_path),
        "PART": f"{archive}.part",
        "ARCHIVE": str(archive),
        "SIZE": str(wait_for),
        "PUBLISHED_WAIT": str(published_wait),
        "HOLD": "1" if hold else "",
    }
    pipe = subprocess.PIPE
    return subprocess.Popen(["bash", "-c", command], stdin=pipe, stdout=pipe, stderr=pipe, env=env)


def _receive(tmp_path: Path, feed: bytes, wait_for: int, **options: Any) -> subprocess.CompletedProcess[bytes]:
    with _start(tmp_path, wait_for, **options) as receiver:
        out, err = receiver.communicate(feed, timeout=60)
    return subprocess.CompletedProcess(receiver.args, receiver.returncode, out, err)


@pytest.fixture
def image() -> tuple[bytes, bytes]:
    """An image's bytes (incompressible, several pipe buffers) and its gzip archive."""
    content = os.urandom(3 << 20)
    return content, gzip.compress(content, compresslevel=1)


def test_the_archive_arrives_whole_while_docker_load_reads_nothing(tmp_path: Path, image: tuple[bytes, bytes]) -> None:
    """With `tee` in the pipeline, a load that stopped reading held up the copy after a pipe buffer (the stall
    watch then ended a live copy: three of eight peer copies of the 832 MB node image on the fleet lab)."""
    content, archive = image
    done = _receive(tmp_path, archive, wait_for=len(archive))
    assert done.returncode == 0, done.stderr.decode()
    assert int((tmp_path / "part-at-load").read_text()) == len(archive)  # all of it there before the load read
    assert (tmp_path / "loaded").read_bytes() == content
    assert (tmp_path / "images" / "a.tar.gz").read_bytes() == archive  # kept whole, to serve other hosts
    assert not (tmp_path / "images" / "a.tar.gz.part").exists()
    assert done.stdout.decode().splitlines()[-1] == "sha256:abc"


def test_a_stream_cut_short_fails_and_keeps_no_archive(tmp_path: Path, image: tuple[bytes, bytes]) -> None:
    _, archive = image
    half = archive[: len(archive) // 2]
    done = _receive(tmp_path, half, wait_for=len(half))
    assert done.returncode != 0
    assert not (tmp_path / "images" / "a.tar.gz").exists()  # only a complete archive serves other hosts


def test_a_tail_that_cannot_follow_a_writer_loads_through_tee(tmp_path: Path, image: tuple[bytes, bytes]) -> None:
    """busybox's tail has no --pid: the stream is split with `tee`, as before."""
    content, archive = image
    busybox = tmp_path / "busybox"
    busybox.mkdir()
    (busybox / "tail").write_text(
        '#!/bin/sh\ncase "$*" in *--pid*) echo "tail: unrecognized option" >&2; exit 1 ;; esac\n'
        'exec /usr/bin/tail "$@"\n'
    )
    (busybox / "tail").chmod(0o755)
    done = _receive(tmp_path, archive, wait_for=0, path=f"{busybox}:")
    assert done.returncode == 0, done.stderr.decode()
    assert (tmp_path / "loaded").read_bytes() == content
    at_load = int((tmp_path / "part-at-load").read_text())
    assert at_load < len(archive), (at_load, len(archive), done.stderr.decode())  # tee: read as it came
    assert (tmp_path / "images" / "a.tar.gz").read_bytes() == archive


def test_a_whole_archive_whose_checksum_matches_is_served_while_the_load_still_runs(
    tmp_path: Path, image: tuple[bytes, bytes]
) -> None:
    content, archive = image
    digest = hashlib.sha256(archive).hexdigest()
    done = _receive(tmp_path, archive, wait_for=len(archive), digest=digest, published_wait=150)
    assert done.returncode == 0, done.stderr.decode()
    assert (tmp_path / "published-while-loading").read_text().strip() == "yes"
    assert (tmp_path / "loaded").read_bytes() == content
    assert (tmp_path / "images" / "a.tar.gz").read_bytes() == archive
    assert not (tmp_path / "images" / "a.tar.gz.part").exists()
    said = done.stdout.decode().splitlines()
    assert said[-1] == "sha256:abc" and said.count(peer_copy.PUBLISHED) == 1


def test_the_command_says_its_archive_was_published_while_its_load_still_runs(
    tmp_path: Path, image: tuple[bytes, bytes]
) -> None:
    """The operator learns it from the command's own output, at once: no polling that a load ending soon after
    can outrun (a CI run's lab missed one host's notice that way)."""
    content, archive = image
    digest = hashlib.sha256(archive).hexdigest()
    with _start(tmp_path, len(archive), digest=digest, published_wait=150, hold=True) as receiver:
        assert receiver.stdin is not None and receiver.stdout is not None
        receiver.stdin.write(archive)
        receiver.stdin.close()
        ready, _, _ = select.select([receiver.stdout], [], [], 30)
        first = receiver.stdout.readline().decode().rstrip("\n") if ready else "(nothing in 30 s)"
        loading = not (tmp_path / "loaded").exists()
        (tmp_path / "go").touch()
        receiver.wait(60)
        rest, err = receiver.stdout.read(), receiver.stderr.read() if receiver.stderr else b""
    assert first == peer_copy.PUBLISHED and loading, (first, err.decode())
    assert receiver.returncode == 0 and rest.decode().splitlines()[-1] == "sha256:abc"
    assert (tmp_path / "loaded").read_bytes() == content


def test_an_archive_whose_checksum_differs_is_served_only_after_its_load(
    tmp_path: Path, image: tuple[bytes, bytes]
) -> None:
    content, archive = image
    wrong = hashlib.sha256(archive + b"x").hexdigest()
    done = _receive(tmp_path, archive, wait_for=len(archive), digest=wrong, published_wait=15)
    assert done.returncode == 0, done.stderr.decode()
    assert (tmp_path / "published-while-loading").read_text().strip() == "no"
    assert (tmp_path / "loaded").read_bytes() == content
    assert (tmp_path / "images" / "a.tar.gz").read_bytes() == archive  # the load verified the image: kept
    assert peer_copy.PUBLISHED not in done.stdout.decode()


def test_a_stream_cut_short_is_never_published(tmp_path: Path, image: tuple[bytes, bytes]) -> None:
    _, archive = image
    half = archive[: len(archive) // 2]
    done = _receive(tmp_path, half, wait_for=len(half), digest=hashlib.sha256(archive).hexdigest(), published_wait=15)
    assert done.returncode != 0
    assert (tmp_path / "published-while-loading").read_text().strip() == "no"
    assert not (tmp_path / "images" / "a.tar.gz").exists() and peer_copy.PUBLISHED not in done.stdout.decode()


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_the_size_command_reads_the_copy_so_far(tmp_path: Path, shell: str) -> None:
    archive = tmp_path / "a.tar.zst"

    def size() -> str:
        run = subprocess.run([shell, "-c", peer_copy.size_command(str(archive))], capture_output=True, timeout=10)
        return run.stdout.decode().strip()

    assert size() == "0"
    (tmp_path / "a.tar.zst.part").write_bytes(b"x" * 10)
    assert size() == "10"
