"""The head-side probe against a GCS address where nothing listens, on loopback (real sockets, a real process).

Ray's GCS client retries its connect for about 40 s there; `status` on a cluster whose head runs but whose GCS
died waited that long. The probe's own TCP connect says it within GCS_CONNECT_S, naming the address.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from raycluster_cli.host import probe


def _closed_port() -> int:
    """A loopback port that nothing listens on (bound once to be free, then closed): a connect is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_gcs_port_that_refuses_gives_one_error_document_naming_it_within_the_connect_bound() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    # Ray's own client would still be retrying at this deadline; the probe has answered long before it.
    done = subprocess.run(
        [sys.executable, "-m", "raycluster_cli.host.probe", "--address", address, "--expect", "127.0.0.1"],
        capture_output=True,
        text=True,
        timeout=probe.GCS_CONNECT_S + 20,
    )

    assert done.returncode == 1
    document = json.loads(done.stdout)  # the one document, nothing else on stdout
    assert document["ok"] is False
    assert document["error"].startswith(f"the head's GCS at {address} does not accept connections ("), document
    assert document["error"].endswith("its gcs_server is not running, or the port is closed on the head")


def test_a_listening_gcs_port_passes_the_connect_check_at_once() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        probe._accepts(f"127.0.0.1:{server.getsockname()[1]}", 5.0)  # returns: no exception


def test_the_connect_check_retries_until_its_bound_then_names_the_refusal() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(probe.GcsAbsent, match=r"does not accept connections \(Connection refused, for 0\.5s\)"):
        probe._accepts(address, 0.5)


def test_auto_and_addresses_without_a_port_are_left_to_ray() -> None:
    probe._accepts("auto", 0.1)  # ray.init's own discovery of a local cluster: nothing to connect to here
