"""Ctrl-C and SIGTERM during `bench` on the real 3-host lab (issue 10): a real SIGINT (or SIGTERM) to the CLI while its counted run
goes ends it with exit 130 within 5 s and one JSON document, and leaves no driver and no stage actor on the
cluster; a bench run after it succeeds. The cluster is brought up first and left as it was found (up, or down)."""

from __future__ import annotations

import signal

import pytest

from .conftest import Lab
from .faults import Verb, wait_until

pytestmark = [pytest.mark.lab, pytest.mark.slow]

_OURS = "$(docker ps -q --filter label=io.raycluster.cluster=lab)"
STAGE_WORKERS = f"docker exec {_OURS} pgrep -f _StageWorker || true"
DRIVERS = f"docker exec {_OURS} pgrep -f raycluster_cli.bench.driver || true"


def _up(lab_hosts: Lab) -> bool:
    """Bring the cluster up; whether it was already up (every node kept running)."""
    code, doc, err = lab_hosts.cli("up", timeout=900)
    assert code == 0 and all(n["alive"] for n in doc["nodes"]), err
    return all(n.get("action") == "running" for n in doc["nodes"])


@pytest.mark.parametrize(
    "signum",
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.extended)],  # one signal is enough for CI
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_during_the_counted_run_stops_driver_and_stages(lab_hosts: Lab, signum: signal.Signals) -> None:
    """30000 short requests: the counted run is far from done when the signal lands, on a fast quiet
    machine too (the test waits for "counted run: requests N/" with N > 0 before signalling). Ctrl-C, and
    SIGTERM (what `timeout`, a service manager or a CI runner sends); the rerun after Ctrl-C only."""
    was_up = _up(lab_hosts)
    small = ("--layers=3", "--d-model=64", "--max-new-tokens=4", "--partition=even", "--refine=0")
    load = ("--requests=30000", "--micro-batch=4", "--in-flight=16", "--no-references", "--calibration-repeats=1")
    try:
        verb = Verb("bench", *small, *load, "--no-network-check", inventory=lab_hosts.inventory)
        try:
            verb.wait_for(r"counted run: requests [1-9]\d*/", timeout=900)
            sent = verb.signal(signum)
            code, doc, ended = verb.finish(timeout=60)
        finally:
            if verb.process.poll() is None:
                verb.process.kill()
        assert code == 130 and ended - sent <= 5, verb.stderr[-3000:]
        assert doc["ok"] is False and doc["interrupted"]["signal"] == signum.name, doc
        assert "Traceback" not in verb.stderr and verb.session_alive() == []
        for hostname in ("lab-h1", "lab-h2", "lab-h3"):  # the driver stopped; Ray ended its actors
            gone = lambda h=hostname: not lab_hosts.sh(h, STAGE_WORKERS).strip()  # noqa: E731
            assert wait_until(gone, 60), (hostname, lab_hosts.sh(hostname, STAGE_WORKERS))
        assert wait_until(lambda: not lab_hosts.sh("lab-h1", DRIVERS).strip(), 30), lab_hosts.sh("lab-h1", DRIVERS)
        if signum == signal.SIGINT:  # the rerun succeeds: the interrupted run left nothing in the next one's way
            code, doc, err = lab_hosts.cli("bench", *small, "--requests=8", "--no-references", "--no-network-check")
            assert code == 0 and doc["completed"] == doc["requests"] == 8, err[-3000:]
    finally:  # the next test finds the lab as this one found it (the doctor tests need it without a cluster)
        if was_up:
            _up(lab_hosts)
        else:
            code, _, err = lab_hosts.cli("down")
            assert code == 0, err
