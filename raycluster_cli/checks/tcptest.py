"""A small TCP latency and bandwidth test (stdlib only) that `doctor --network` runs on two hosts.

Sent as a script on stdin (`python3 - serve ADDRESS PORT IDLE_S` on the head, `python3 - measure HEAD PORT
SECONDS` on a worker), either with the host's python3 or inside the node image. One JSON line comes out of
`measure`: round-trip time, and bandwidth worker → head ("up") and head → worker ("down").
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import threading
import time

CHUNK = 1 << 16
PINGS = 20
MAX_SECONDS = 60.0  # the longest upload or download a connection may ask for (doctor asks 2 s, bench 1 s)
IO_S = 10.0  # a connection silent this long (no mode byte, no data) is closed
MAX_CONNECTIONS = 8  # answered at once; more are closed at once


def serve(address: str, port: int, idle_s: float) -> None:
    """Answer ping (P), upload (U) and download (D) connections until quit (Q) or `idle_s` without one.

    Each connection is answered in a thread of its own, so one that says nothing holds up no other; each is
    closed after IO_S of silence and MAX_SECONDS + IO_S in all, and a download lasts at most MAX_SECONDS
    whatever it asks for (issue 34, item 16: one connection at a time, and `D inf` streamed forever)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((address, port))
    server.listen(MAX_CONNECTIONS)
    server.settimeout(0.2)
    quit_ = threading.Event()
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
    active = [0]
    lock = threading.Lock()
    last = time.monotonic()
    with server:
        while not quit_.is_set():
            try:
                conn, _ = server.accept()
            except socket.timeout:  # noqa: UP041 (a host's python3 may be older than 3.10)
                with lock:
                    busy = active[0] > 0
                if busy:
                    last = time.monotonic()
                elif time.monotonic() - last > idle_s:
                    return
                continue
            except OSError:
                return
            last = time.monotonic()
            if not slots.acquire(blocking=False):
                conn.close()
                continue
            with lock:
                active[0] += 1

            def answer(conn: socket.socket = conn) -> None:
                try:
                    with conn:
                        _answer(conn, quit_)
                except OSError:
                    pass  # the peer went away, or was silent for IO_S
                finally:
                    with lock:
                        active[0] -= 1
                    slots.release()

            threading.Thread(target=answer, daemon=True).start()


def _answer(conn: socket.socket, quit_: threading.Event) -> None:
    """One connection: its mode byte, then its exchange, under IO_S per read and MAX_SECONDS + IO_S in all."""
    conn.settimeout(IO_S)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    end = time.monotonic() + MAX_SECONDS + IO_S
    mode = conn.recv(1)
    if mode == b"Q":
        quit_.set()
    elif mode == b"P":
        while time.monotonic() < end and (data := conn.recv(64)):
            conn.sendall(data)
    elif mode == b"U":
        total = 0
        while time.monotonic() < end and (chunk := conn.recv(CHUNK)):
            total += len(chunk)
        conn.sendall(str(total).encode())
    elif mode == b"D":
        asked = conn.recv(16).decode(errors="replace").strip()
        try:
            seconds = float(asked)
        except ValueError:
            return
        if not 0 <= seconds < float("inf"):  # NaN, negative or infinite: nothing
            return
        payload = b"\0" * CHUNK
        stop = time.monotonic() + min(seconds, MAX_SECONDS)
        while time.monotonic() < stop:
            conn.sendall(payload)


def _connect(host: str, port: int, wait_s: float = 30.0) -> socket.socket:
    """Connect, retrying while the server is still starting (it may be a `docker run` away)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=10)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def measure(host: str, port: int, seconds: float) -> dict[str, float]:
    seconds = min(seconds, MAX_SECONDS)
    with _connect(host, port) as conn:
        conn.sendall(b"P")
        rtts = []
        for _ in range(PINGS):
            start = time.perf_counter()
            conn.sendall(b"x")
            if not conn.recv(64):
                break
            rtts.append((time.perf_counter() - start) * 1000)
    with _connect(host, port) as conn:
        conn.sendall(b"U")
        payload = b"\0" * CHUNK
        start = time.perf_counter()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        total = int(conn.recv(64).decode() or 0)
        up = total * 8 / (time.perf_counter() - start)
    with _connect(host, port) as conn:
        conn.sendall(b"D" + f"{seconds:<15}".encode())
        received = 0
        start = time.perf_counter()
        while chunk := conn.recv(CHUNK):
            received += len(chunk)
        down = received * 8 / (time.perf_counter() - start)
    with _connect(host, port) as conn:
        conn.sendall(b"Q")
    return {"rtt_ms": statistics.median(rtts) if rtts else -1.0, "up_bps": up, "down_bps": down}


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        serve(argv[1], int(argv[2]), float(argv[3]))
        return 0
    if argv[:1] == ["measure"]:
        print(json.dumps(measure(argv[1], int(argv[2]), float(argv[3]))), flush=True)
        return 0
    print("usage: serve ADDRESS PORT IDLE_S | measure HOST PORT SECONDS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
