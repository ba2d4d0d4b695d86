"""``node.reach.unreachable`` over real sockets on loopback: a listening port is reached, a refused one is not, and
the answer comes within the deadline."""

from __future__ import annotations

import socket
import time

from raycluster_cli.node.reach import unreachable


def test_a_listening_port_is_reached_and_a_closed_one_is_not_within_the_deadline() -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: the connection is refused
        began = time.monotonic()
        missed = unreachable(
            [("up", "127.0.0.1", listening.getsockname()[1]), ("down", "127.0.0.1", closed.getsockname()[1])],
            timeout_s=1.0,
        )
    assert missed == ["down"] and time.monotonic() - began < 1.5
    assert unreachable([]) == []
