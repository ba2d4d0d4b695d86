"""The receiver's side of a relay copy (image/receive.py) under a real bash, with real `timeout`, `gzip`,
`sha256sum` (or python3, or openssl) and a fake `docker` that records what it loads: the content arrives on stdin,
as the operator's stream gives it, or from a listener on loopback (a peer's copy: the real LISTENER, or one that
does not know the copy's answer). Nothing is used before all of it is there and its SHA-256 is the operator's."""

from __future__ import annotations

import gzip
import hashlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raycluster_cli.delivery import peer_copy, receive

FAKE_DOCKER = """#!/bin/sh
case "$1" in
load) cat >"$D/loaded" && echo "Loaded image ID: sha256:abc" ;;
image) echo "sha256:abc" ;;
esac
"""
USE = 'gzip -dc <"$a" | docker load -q >&2 && docker image inspect --format x img:1'


def _bin(tmp_path: Path, without: tuple[str, ...] = ()) -> str:
    """A PATH: the fake docker, and (with `without`) every tool of /usr/bin and /bin except those named."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "docker").write_text(FAKE_DOCKER)
    (fake / "docker").chmod(0o755)
    if not without:
        return f"{fake}:/usr/bin:/bin"
    for folder in ("/usr/bin", "/bin"):
        for name in os.listdir(folder):
            if name not in without and not (fake / name).exists():
                (fake / name).symlink_to(os.path.join(folder, name))
    return str(fake)


def _command(tmp_path: Path, digest: str, source: str = "") -> tuple[str, Path]:
    staging = tmp_path / "staging"
    archive = staging / "a.tar.gz"
    return receive.receive_script(receive.receive_command(str(archive), digest, USE, source)), archive


def _receive(
    tmp_path: Path, feed: bytes, digest: str, without: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[bytes]:
    command, _ = _command(tmp_path, digest)
    env = {"PATH": _bin(tmp_path, without), "D": str(tmp_path)}
    return subprocess.run(["bash", "-c", command], input=feed, capture_output=True, env=env, timeout=60)


@pytest.fixture
def image() -> tuple[bytes, bytes, str]:
    """An image's bytes (incompressible, several pipe buffers), its gzip archive and the archive's SHA-256."""
    content = os.urandom(3 << 20)
    archive = gzip.compress(content, compresslevel=1)
    return content, archive, hashlib.sha256(archive).hexdigest()


def test_a_whole_archive_whose_sha256_matches_is_published_then_loaded(tmp_path: Path, image: tuple) -> None:
    content, archive, digest = image
    done = _receive(tmp_path, archive, digest)
    assert done.returncode == 0, done.stderr.decode()
    said = done.stdout.decode().splitlines()
    assert said == [receive.PUBLISHED, "sha256:abc"]  # published (and said so) before the load's result
    assert (tmp_path / "loaded").read_bytes() == content
    assert (tmp_path / "staging" / "a.tar.gz").read_bytes() == archive  # kept whole, to serve other hosts
    assert sorted(os.listdir(tmp_path / "staging")) == ["a.tar.gz"]  # no .part, no pid file
    assert oct((tmp_path / "staging").stat().st_mode & 0o777) == "0o700"


def test_a_byte_flipped_in_flight_is_never_loaded(tmp_path: Path, image: tuple) -> None:
    """Before, the load ran beside the check: a corrupt archive was loaded, only not served on."""
    _, archive, digest = image
    flipped = bytearray(archive)
    flipped[len(archive) // 2] ^= 0x01
    done = _receive(tmp_path, bytes(flipped), digest)
    assert done.returncode == receive.CORRUPT_RC
    assert receive.CORRUPT in done.stderr.decode() and digest[:16] in done.stderr.decode()
    assert not (tmp_path / "loaded").exists()  # docker load never ran
    assert os.listdir(tmp_path / "staging") == []  # nothing to serve, no partial file
    assert receive.PUBLISHED not in done.stdout.decode()


def test_a_stream_cut_short_is_never_loaded_nor_published(tmp_path: Path, image: tuple) -> None:
    _, archive, digest = image
    done = _receive(tmp_path, archive[: len(archive) // 2], digest)
    assert done.returncode == receive.CORRUPT_RC
    assert not (tmp_path / "loaded").exists() and os.listdir(tmp_path / "staging") == []


@pytest.mark.parametrize("without", [("sha256sum",), ("sha256sum", "python3")])
def test_without_sha256sum_another_tool_verifies(tmp_path: Path, image: tuple, without: tuple[str, ...]) -> None:
    """python3's hashlib, else openssl: never a silent skip (before, no sha256sum meant no check at all)."""
    if "python3" in without and not any(os.path.exists(f"{d}/openssl") for d in ("/usr/bin", "/bin")):
        pytest.skip("no openssl on this machine")
    content, archive, digest = image
    if "python3" in without:
        without = (*without, *(n for d in ("/usr/bin", "/bin") for n in os.listdir(d) if n.startswith("python")))
    done = _receive(tmp_path, archive, digest, without=without)
    assert done.returncode == 0, done.stderr.decode()
    assert (tmp_path / "loaded").read_bytes() == content
    flipped = archive[:-1] + bytes([archive[-1] ^ 1])
    (tmp_path / "loaded").unlink()
    done = _receive(tmp_path, flipped, digest, without=without)
    assert done.returncode == receive.CORRUPT_RC and not (tmp_path / "loaded").exists()


def test_a_host_with_no_tool_to_verify_refuses_by_name(tmp_path: Path, image: tuple) -> None:
    _, archive, digest = image
    pythons = tuple(n for d in ("/usr/bin", "/bin") for n in os.listdir(d) if n.startswith("python"))
    done = _receive(tmp_path, archive, digest, without=("sha256sum", "openssl", *pythons))
    assert done.returncode == 9
    assert f"{receive.NO_HASH} {socket.gethostname()} has no sha256sum, python3 or openssl" in done.stderr.decode()
    assert not (tmp_path / "loaded").exists() and os.listdir(tmp_path / "staging") == []


def _planted(tmp_path: Path, kind: str) -> Path:
    staging = tmp_path / "staging"
    if kind == "link":
        (tmp_path / "elsewhere").mkdir()
        staging.symlink_to(tmp_path / "elsewhere")
    elif kind == "open":
        staging.mkdir()
        staging.chmod(0o777)
    else:  # another user's
        staging.mkdir(mode=0o700)
        os.chown(staging, 65534, 65534)
    return staging


@pytest.mark.parametrize("kind", ["link", "open", "foreign"])
def test_a_staging_folder_that_is_not_the_login_users_own_is_refused(tmp_path: Path, image: tuple, kind: str) -> None:
    """Before, `mkdir -p` accepted a folder another user had made in /var/tmp, and whatever was in it."""
    if kind == "foreign" and os.geteuid() != 0:
        pytest.skip("making a folder another user owns needs root")
    _, archive, digest = image
    staging = _planted(tmp_path, kind)
    done = _receive(tmp_path, archive, digest)
    assert done.returncode == 3
    words = {"link": "is a link or a file", "open": "has mode 777", "foreign": "belongs to nobody"}[kind]
    assert f"{receive.STAGING_REFUSED} {staging} on " in done.stderr.decode() and words in done.stderr.decode()
    assert not (tmp_path / "loaded").exists() and not (staging / "a.tar.gz.part").exists()


def test_a_copy_ended_by_sigterm_leaves_no_partial_file(tmp_path: Path, image: tuple) -> None:
    """As the SSH guard ends it after Ctrl-C (its session's process group): the EXIT trap removes the .part."""
    _, archive, digest = image
    command, path = _command(tmp_path, digest)
    env = {"PATH": _bin(tmp_path), "D": str(tmp_path)}
    pipe = subprocess.PIPE
    with subprocess.Popen(["bash", "-c", command], stdin=pipe, stdout=pipe, stderr=pipe, env=env,
                          start_new_session=True) as receiver:  # fmt: skip
        assert receiver.stdin is not None
        receiver.stdin.write(archive[: len(archive) // 2])
        receiver.stdin.flush()
        part = Path(f"{path}.part")
        deadline = time.monotonic() + 10
        while not (part.exists() and part.stat().st_size > 0):
            assert time.monotonic() < deadline, "the copy never began"
            time.sleep(0.05)
        os.killpg(receiver.pid, signal.SIGTERM)
        receiver.wait(20)
    assert receiver.returncode != 0
    assert os.listdir(tmp_path / "staging") == []


def _run(command: str) -> None:
    subprocess.run(["sh", "-c", command], check=True, timeout=10)


@pytest.mark.parametrize("content", ["-1", "1", "", "12ab", "0"])
def test_a_pid_file_that_is_not_a_live_timeout_process_is_never_signalled(tmp_path: Path, content: str) -> None:
    """`kill -TERM -- $(cat pidfile)` with `-1` in it signalled every process the user may signal."""
    archive = tmp_path / "a.tar.gz"
    Path(f"{archive}.part.pid").write_text(content)
    with subprocess.Popen(["sleep", "30"]) as bystander:
        if content == "0":  # a live process that is not our `timeout`
            Path(f"{archive}.part.pid").write_text(str(bystander.pid))
        _run(receive.stop_command(str(archive)))
        time.sleep(0.2)
        assert bystander.poll() is None
        bystander.kill()


def test_the_stop_command_ends_the_copys_timeout(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar.gz"
    with subprocess.Popen(["timeout", "30", "sleep", "30"]) as copy:
        Path(f"{archive}.part.pid").write_text(f"{copy.pid}\n")
        deadline = time.monotonic() + 5
        while Path(f"/proc/{copy.pid}/comm").read_text().strip() != "timeout":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        _run(receive.stop_command(str(archive)))
        assert copy.wait(10) != 0


class _Sender:
    """A listener on loopback: the real one (it knows the copy's answer) or an impostor (it does not)."""

    def __init__(self, tmp_path: Path, archive: bytes, copy: peer_copy.Copy, real: bool) -> None:
        self.path = tmp_path / "served.tar.gz"
        self.path.write_bytes(archive)
        self.copy = copy
        if real:
            args = [copy.address, copy.port, self.path, 60, 20, peer_copy.HELLO_S, peer_copy.PENDING]
            self.process: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-c", peer_copy.LISTENER, *map(str, args)], stdin=subprocess.PIPE
            )
            assert self.process.stdin is not None
            self.process.stdin.write(copy.stdin)
            self.process.stdin.close()
        else:
            self.process = None
            server = socket.create_server((copy.address, copy.port))
            threading.Thread(target=self._impostor, args=(server, archive), daemon=True).start()

    def _impostor(self, server: socket.socket, archive: bytes) -> None:
        with server:
            for _ in range(5):  # the receiver's reachability probe, then its copy
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(2)
                    try:
                        if conn.recv(100):
                            conn.sendall(b"not-the-answer\n" + archive)
                            return
                    except OSError:
                        continue


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("real", [True, False])
def test_a_peer_copy_is_taken_only_from_a_sender_that_answers_with_the_copys_secret(
    tmp_path: Path, image: tuple, real: bool
) -> None:
    content, archive, digest = image
    copy = peer_copy.Copy("a", "b", "127.0.0.1", _free_port(), secrets.token_hex(24), secrets.token_hex(24))
    sender = _Sender(tmp_path, archive, copy, real)
    command, _ = _command(tmp_path, digest, f"127.0.0.1 {copy.port}")
    env = {"PATH": _bin(tmp_path), "D": str(tmp_path)}
    done = subprocess.run(["bash", "-c", command], input=copy.stdin, capture_output=True, env=env, timeout=60)
    if sender.process is not None:
        sender.process.wait(20)
    if real:
        assert done.returncode == 0, done.stderr.decode()
        assert (tmp_path / "loaded").read_bytes() == content
    else:
        assert done.returncode == 3 and receive.SENDER_UNPROVEN in done.stderr.decode()
        assert not (tmp_path / "loaded").exists() and os.listdir(tmp_path / "staging") == []


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_the_size_command_reads_the_copy_so_far(tmp_path: Path, shell: str) -> None:
    archive = tmp_path / "a.tar.zst"

    def size() -> str:
        run = subprocess.run([shell, "-c", receive.size_command(str(archive))], capture_output=True, timeout=10)
        return run.stdout.decode().strip()

    assert size() == "0"
    (tmp_path / "a.tar.zst.part").write_bytes(b"x" * 10)
    assert size() == "10"


def test_down_purge_removes_only_the_login_users_own_staging_folder(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (mine / "x.tar.zst").write_bytes(b"x")
    out = subprocess.run(["sh", "-c", receive.purge_command(str(mine))], capture_output=True, text=True, timeout=10)
    assert out.stdout.split() == ["removed"] and not mine.exists()
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        out = subprocess.run(["sh", "-c", receive.purge_command(str(theirs))], capture_output=True, text=True)
        assert out.stdout.split() == [] and theirs.exists()


def test_the_clean_up_removes_nothing_from_a_folder_that_is_not_the_login_users_own(tmp_path: Path) -> None:
    """Root's `rm -f` removed a file planted in another user's folder (found by the lab test)."""
    for kind in ("open", *(("foreign",) if os.geteuid() == 0 else ())):
        staging = tmp_path / kind
        staging.mkdir(mode=0o700)
        (staging / "a.tar").write_text("planted")
        if kind == "open":
            staging.chmod(0o777)
        else:
            os.chown(staging, 65534, 65534)
        _run(receive.cleanup_command(str(staging / "a.tar")))
        assert (staging / "a.tar").read_text() == "planted", kind
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    for name in ("a.tar", "a.tar.part", "a.tar.part.pid"):
        (mine / name).write_text("x")
    _run(receive.cleanup_command(str(mine / "a.tar")))
    assert list(mine.iterdir()) == []
