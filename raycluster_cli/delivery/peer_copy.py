"""Host-to-host copies of the relay (image archives and models alike): a host that has the content serves it to
one that lacks it.

The operator schedules (as Dragonfly's scheduler and Kraken's tracker do) but runs no agent anywhere:
each copy is two SSH commands started together. The sender runs a one-shot listener (the host's python3,
else the node image's own python3 in `docker run --network host`) bound to its cluster address on a
random port; the receiver (bash's /dev/tcp, no python needed) connects and presents the copy's one-time `ask`
secret; the listener answers with its `answer` secret, then sends the content. Both secrets reach both ends on
stdin, never on a command line; the listener reads every connection side by side, serves the first one that
presents `ask` and closes; a receiver that does not hear `answer` takes nothing (delivery/receive.py). Every copy
has a deadline, a stall timeout on both ends and a short connect window, so a host that cannot reach another
fails fast and is served by the operator instead.

A copy is done as soon as the receiver's file is whole and its SHA-256 is the operator's (delivery/receive.py):
only then is it published under its serving name and used. Its sender is then free, and a receiver whose
listener runs on the host's python3 (or a model's receiver, whose hosts have the node image) serves others
from then on, while it uses its copy (delivery/schedule.py).
"""

from __future__ import annotations

import contextlib
import random
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from raycluster_cli.delivery.receive import (
    CONNECT_S,
    DEADLINE_S,
    PUBLISHED,
    folder_of,
    receive_command,
    receive_script,
    size_command,
    stop_command,
)
from raycluster_cli.host.folders import ARCHIVE_DIR
from raycluster_cli.transport import Transport, quote

__all__ = ["CONNECT_S", "DEADLINE_S", "PUBLISHED", "receive_command", "receive_script"]

PORTS = (20000, 32000)  # below Linux's ephemeral range, so a listener rarely meets a port in use
STALL_S = 60.0  # no byte for this long ends a copy (both ends, and the operator's watch)
POLL_S = 2.0  # how often the operator reads a receiver's byte count for its progress bar

HELLO_S = 5.0  # how long a connection to a listener has to present the secret (a receiver sends it at once)
PENDING = 64  # connections still to present it, at most; more are closed at once

# The sender's listener: serve ARCHIVE to the first connection that presents the ask secret (stdin's first line),
# answered with the answer secret (its second line) before the content, then exit. argv: address port archive stall_s wait_s hello_s pending. Prints the bytes sent. Connections are read
# side by side (one selector), each given hello_s to present its line: one that says nothing holds up no other
# (issue 34, item 16: they were taken one at a time, 10 s each, so a few silent ones outlasted the wait).
LISTENER = """
import selectors, socket, sys, time
try:
    from hmac import compare_digest
except ImportError:  # Debian's python3-minimal has no hmac module: the C function hmac itself uses
    from _operator import _compare_digest as compare_digest
addr, port, path, stall, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
hello, most = float(sys.argv[6]), int(sys.argv[7])
secret = sys.stdin.readline().strip().encode()
answer = sys.stdin.readline().strip().encode()
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
    if now >= end or not secret or not answer:
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
        if data and b"\\n" in got and compare_digest(line, secret):
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
conn.sendall(answer + b"\\n")
with open(path, "rb") as source:
    sent = conn.sendfile(source)
conn.shutdown(socket.SHUT_WR)
conn.close()
print(sent)
"""


@dataclass(frozen=True)
class Copy:
    """One host-to-host copy: who sends, who receives, over which address and port, with which secrets (`secret`:
    the receiver's to present, `answer`: the sender's reply, proving it to the receiver)."""

    sender: str
    receiver: str
    address: str  # the sender's cluster address: the listener binds it, the receiver dials it
    port: int
    secret: str
    answer: str = ""

    @property
    def stdin(self) -> bytes:
        """What both ends read on stdin: the two secrets, one a line."""
        return f"{self.secret}\n{self.answer}\n".encode()

    @staticmethod
    def new(sender: str, receiver: str, address: str) -> Copy:
        return Copy(sender, receiver, address, random.randint(*PORTS), secrets.token_hex(24), secrets.token_hex(24))


def archive_path(image_id: str, suffix: str, directory: str = ARCHIVE_DIR) -> str:
    return f"{directory}/{image_id[7:19]}.{suffix}"


def listener_command(copy: Copy, archive: str, image: str) -> str:
    """The sender's side: python3 on the host, else the image's own python3 (the sender has the image)."""
    args = quote(copy.address, copy.port, archive, STALL_S, CONNECT_S + 10, HELLO_S, PENDING)
    script = quote(LISTENER)
    in_image = (
        f"docker run --rm -i --network host --log-driver none -v {quote(f'{folder_of(archive)}:{folder_of(archive)}:ro')} "
        f"--entrypoint python3 {quote(image)} -c {script} {args}"
    )
    return (
        f"if command -v python3 >/dev/null 2>&1; then exec timeout {DEADLINE_S:.0f} python3 -c {script} {args}; "
        f"else exec {in_image}; fi"
    )


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
