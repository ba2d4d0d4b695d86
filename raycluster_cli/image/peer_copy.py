"""Host-to-host image copies: a host that has the image archive serves it to one that lacks it.

The operator schedules (as Dragonfly's scheduler and Kraken's tracker do) but runs no agent anywhere:
each copy is two SSH commands started together. The sender runs a one-shot listener (the host's python3,
else the node image's own python3 in `docker run --network host`) bound to its cluster address on a
random port; the receiver (bash's /dev/tcp, no python needed) connects, sends the transfer's one-time
secret, and pipes what comes back through the decompressor into `docker load`, keeping a copy of the
archive to serve others. The secret reaches both ends on stdin, never on a command line; the listener
reads every connection side by side, serves the first one that presents it and closes. Every copy has a deadline, a stall timeout on
both ends and a short connect window, so a host that cannot reach another fails fast and is served by
the operator instead. The image ID is verified on arrival, as after an operator stream.

A copy is done as soon as the receiver's archive is whole, while its own `docker load` still runs (40–60 s of
a multi-GB image, against seconds for the copy): the archive's SHA-256 (the operator's, computed once) is
checked as it arrives, and only an archive that matches is published under its serving name. Its sender is
then free, and a receiver whose listener runs on the host's python3 serves others from then on; one whose
listener runs in the image serves once its load is done (image/schedule.py).
"""

from __future__ import annotations

import contextlib
import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from raycluster_cli.host.folders import ARCHIVE_DIR
from raycluster_cli.transport import Transport, quote

PORTS = (20000, 32000)  # below Linux's ephemeral range, so a listener rarely meets a port in use
CONNECT_S = 20.0  # how long a receiver tries to reach the sender's listener before giving up
STALL_S = 60.0  # no byte for this long ends a copy (both ends, and the operator's watch)
DEADLINE_S = 1800.0  # the whole copy
POLL_S = 2.0  # how often the operator reads a receiver's byte count for its progress bar
# What a receive command prints (a line of its own, before the image ID) the moment its archive is whole, its
# SHA-256 matched and it was published under its serving name: the operator hears it as it happens.
PUBLISHED = "raycluster: archive whole, SHA-256 matched, published"

HELLO_S = 5.0  # how long a connection to a listener has to present the secret (a receiver sends it at once)
PENDING = 64  # connections still to present it, at most; more are closed at once

# The sender's listener: serve ARCHIVE to the first connection that presents the secret (read on stdin), then
# exit. argv: address port archive stall_s wait_s hello_s pending. Prints the bytes sent. Connections are read
# side by side (one selector), each given hello_s to present its line: one that says nothing holds up no other
# (issue 34, item 16: they were taken one at a time, 10 s each, so a few silent ones outlasted the wait).
LISTENER = """
import hmac, selectors, socket, sys, time
addr, port, path, stall, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
hello, most = float(sys.argv[6]), int(sys.argv[7])
secret = sys.stdin.readline().strip().encode()
server = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
server.bind((addr, port))
server.listen(64)
server.setblocking(False)
sel = selectors.DefaultSelector()
sel.register(server, selectors.EVENT_READ)
pending = {}
end = time.monotonic() + wait
winner = None

def drop(conn):
    sel.unregister(conn)
    del pending[conn]
    conn.close()

while winner is None:
    now = time.monotonic()
    if now >= end or not secret:
        sys.exit("no receiver presented the transfer's secret in time")
    for conn in [c for c, (due, _) in pending.items() if due <= now]:
        drop(conn)
    due = min([end] + [d for d, _ in pending.values()])
    for key, _ in sel.select(max(0.01, due - now)):
        conn = key.fileobj
        if conn is server:
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            if len(pending) >= most:
                conn.close()
                continue
            conn.setblocking(False)
            pending[conn] = (time.monotonic() + hello, b"")
            sel.register(conn, selectors.EVENT_READ)
            continue
        if conn not in pending:
            continue
        try:
            data = conn.recv(256)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        got = pending[conn][1] + data
        if data and b"\\n" not in got and len(got) < 200:
            pending[conn] = (pending[conn][0], got)
            continue
        line = got.split(b"\\n", 1)[0].strip()
        if data and b"\\n" in got and hmac.compare_digest(line, secret):
            sel.unregister(conn)
            del pending[conn]
            winner = conn
            break
        drop(conn)
for conn in list(pending):
    drop(conn)
server.close()
conn = winner
conn.setblocking(True)
conn.settimeout(stall)
with open(path, "rb") as source:
    sent = conn.sendfile(source)
conn.shutdown(socket.SHUT_WR)
conn.close()
print(sent)
"""


@dataclass(frozen=True)
class Copy:
    """One host-to-host copy: who sends, who receives, over which address and port, with which secret."""

    sender: str
    receiver: str
    address: str  # the sender's cluster address: the listener binds it, the receiver dials it
    port: int
    secret: str

    @staticmethod
    def new(sender: str, receiver: str, address: str) -> Copy:
        return Copy(sender, receiver, address, random.randint(*PORTS), secrets.token_hex(24))


def archive_path(image_id: str, suffix: str, directory: str = ARCHIVE_DIR) -> str:
    return f"{directory}/{image_id[7:19]}.{suffix}"


def _folder(archive: str) -> str:
    return archive.rsplit("/", 1)[0] or "/"


def listener_command(copy: Copy, archive: str, image: str) -> str:
    """The sender's side: python3 on the host, else the image's own python3 (the sender has the image)."""
    args = quote(copy.address, copy.port, archive, STALL_S, CONNECT_S + 10, HELLO_S, PENDING)
    script = quote(LISTENER)
    in_image = (
        f"docker run --rm -i --network host --log-driver none -v {quote(f'{_folder(archive)}:{_folder(archive)}:ro')} "
        f"--entrypoint python3 {quote(image)} -c {script} {args}"
    )
    return (
        f"if command -v python3 >/dev/null 2>&1; then exec timeout {DEADLINE_S:.0f} python3 -c {script} {args}; "
        f"else exec {in_image}; fi"
    )


def receive_command(archive: str, decompress: str, image: str, source: str = "", digest: str = "") -> str:
    """The receiver's side, with the archive on stdin (from the operator) or from `source` (`IP PORT` of a
    sender's listener, secret first on stdin): keep a copy, load it, print the loaded image ID last.

    The archive is written to its file as it arrives and `docker load` follows that file (`tail --pid -f`):
    a load that stops reading for a while (a multi-GB layer being committed) no longer holds up the copy, so
    the stall watch (the file's growth) sees the network alone. With `digest` (the archive's SHA-256, hex), a
    second follower sums the file as it grows, and once the copy is whole and matches, the file is linked
    under the archive's own name, which is what a listener serves, and the command prints PUBLISHED: the
    operator hears it at once (a line of the command's own output), and the host serves others while its load
    runs on. Where `tail` cannot follow a writer (busybox), `tee` splits the stream as before and the archive
    is served after the load. It all runs under `timeout` (its process group is what the operator's stall
    watch kills: the pid is written next to the archive)."""
    part = f"{archive}.part"
    publish = (
        f"{{ tail -c +1 -s 0.2 --pid=$c -f {quote(part)} | sha256sum | {{ read -r s _; "
        f'[ "$s" = {quote(digest)} ] && ln -f {quote(part)} {quote(archive)} && echo {quote(PUBLISHED)}; }}; '
        "true; } & p=$!; "
        if digest
        else ""
    )
    wait_all = 'wait "$c" && wait "$p"' if digest else 'wait "$c"'
    follow = (
        f": >{quote(part)}; exec 5<&0; cat <&5 >>{quote(part)} & c=$!; exec 5<&-; {publish}"
        f"tail -c +1 -s 0.2 --pid=$c -f {quote(part)} | {decompress} | docker load -q "
        f'|| {{ r=$?; kill "$c" 2>/dev/null; exit "$r"; }}; {wait_all}'
    )
    load = (
        f"if tail --pid=1 -c 0 /dev/null >/dev/null 2>&1; then {follow}; "
        f"else tee {quote(part)} | {decompress} | docker load -q; fi"
    )
    if source:
        address, port = source.split()
        dial = f"/dev/tcp/{address}/{port}"
        fetch = (
            "IFS= read -r secret; "
            f"end=$((SECONDS + {CONNECT_S:.0f})); "
            f"until timeout 5 bash -c {quote(f'exec 3<>{dial}')} 2>/dev/null; do "
            f'[ "$SECONDS" -lt "$end" ] || {{ echo "cannot reach {address}:{port}" >&2; exit 3; }}; sleep 0.3; done; '
            f"exec 3<>{dial}; "
            "printf '%s\\n' \"$secret\" >&3; "
            f"timeout -k 5 {DEADLINE_S:.0f} bash -c {quote('set -o pipefail; ' + load)} <&3 & "
        )
    else:
        # A background job's stdin is /dev/null unless redirected: hand it the archive on fd 4.
        fetch = f"exec 4<&0; timeout -k 5 {DEADLINE_S:.0f} bash -c {quote('set -o pipefail; ' + load)} <&4 & "
    return (
        f"umask 077; mkdir -p {quote(_folder(archive))} && rm -f {quote(part)} && {fetch}"
        f"pid=$!; echo $pid > {quote(part)}.pid; wait $pid; rc=$?; rm -f {quote(part)}.pid; "
        f'[ "$rc" = 0 ] || exit "$rc"; '
        f"{{ if [ {quote(part)} -ef {quote(archive)} ]; then rm -f {quote(part)}; "  # published while it loaded
        f"else mv -f {quote(part)} {quote(archive)}; fi; }} && "
        f"docker image inspect --format '{{{{.Id}}}}' {quote(image)}"
    )


def receive_script(command: str) -> str:
    """Receivers run under bash (for /dev/tcp and pipefail), whatever the login shell is."""
    return f"exec bash -c {quote(command)}"


def size_command(archive: str) -> str:
    """The bytes of the copy so far."""
    return f"stat -c %s {quote(archive + '.part')} 2>/dev/null || echo 0"


def stop_command(archive: str) -> str:
    """End a stalled copy: TERM to the receiver's `timeout` process (which passes it to its group)."""
    pid = quote(archive + ".part.pid")
    return f"[ -f {pid} ] && kill -TERM -- $(cat {pid}) 2>/dev/null; true"


def cleanup_command(archive: str) -> str:
    return f"rm -f {quote(archive)} {quote(archive + '.part')} {quote(archive + '.part.pid')}"


class Watch:
    """Poll a receiver's byte count for its progress bar; stop the copy when no byte arrived for STALL_S.

    Once all `total` bytes are there the watch ends: what remains is the host's `docker load` reading its
    file, which may go quiet for longer than STALL_S (a large layer committed) and is bounded by the copy's
    deadline. (That the archive is whole and checked, the receive command says itself: PUBLISHED.)"""

    def __init__(self, transport: Transport, archive: str, report: Callable[[int], None], total: int = 0) -> None:
        self.transport, self.archive, self.report, self.total = transport, archive, report, total
        self.stalled = False
        self.seen = -1  # the receiver's bytes at the last poll that answered (-1: none yet)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        since = time.monotonic()
        while not self._done.wait(POLL_S):
            try:
                words = self.transport.run(size_command(self.archive), timeout=30).stdout.split()
            except Exception:
                continue  # the copy itself reports a lost host
            size = int(words[0]) if words and words[0].isdigit() else 0
            if size > self.seen:
                self.seen, since = size, time.monotonic()
                self.report(size)
                if self.total and size >= self.total:
                    return
            elif time.monotonic() - since > STALL_S:
                self.stalled = True
                with contextlib.suppress(Exception):
                    self.transport.run(stop_command(self.archive), timeout=30)
                return
