"""Faults during the verbs that talk to the head's dashboard (issue 33): `submit` following a job's log and
`dashboard` forwarding a port, each while the link to the head's sshd is cut for real (iptables on lab-h1),
and `metrics` while a worker machine is frozen (`docker pause`). Each ends, or recovers, within its
deadlines and names the host; every test puts the lab back in `finally`."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import IP1, IP2, IP3, Lab
from .faults import CUT, LOGIN_DEADLINE_S, SLACK_S, UNCUT, Verb, dashboard, frozen, quick_inventory, wait_until

pytestmark = pytest.mark.lab
KEEPALIVE_DEADLINE_S = 6  # QUICK_SSH: 2 s × 3 of silence


@pytest.fixture(scope="module")
def cluster(lab_hosts: Lab, tmp_path_factory: pytest.TempPathFactory) -> str:
    quick = quick_inventory(lab_hosts, tmp_path_factory.mktemp("faults-tools") / "quick.yaml")
    code, doc, err = lab_hosts.cli("up", "--timeout", "180", inventory=quick, timeout=900)
    assert code == 0 and all(n["alive"] for n in doc["nodes"]), err
    return quick


@pytest.fixture
def token() -> str:
    return (Path(os.environ["RAYCLUSTER_STATE_DIR"]) / "lab" / "auth-token").read_text().strip()


@pytest.fixture
def ssh_to_head_cut(lab_hosts: Lab) -> Iterator[None]:
    """Yields at once; the test cuts the link with CUT when it is ready; always put back."""
    try:
        yield
    finally:
        lab_hosts.sh_result("lab-h1", f"while {UNCUT} 2>/dev/null; do :; done")


def test_submit_whose_link_to_the_head_is_cut_while_it_follows_the_log_ends_in_time_naming_it(
    lab_hosts: Lab, cluster: str, ssh_to_head_cut: None
) -> None:
    """The job runs on (the cluster is fine); the operator's view of it is lost: `submit` says so within the
    keepalive and one login, exit 1, one JSON document naming the head, nothing left running here."""
    job = "import time; print('job started', flush=True); time.sleep(40); print('job done')"
    verb = Verb("submit", inventory=cluster, words=("--", "python", "-c", job))
    try:
        verb.wait_for("job started", timeout=300)
        lab_hosts.sh("lab-h1", CUT)
        cut_at = time.monotonic()
        code, doc, ended = verb.finish(timeout=180)
    finally:
        if verb.process.poll() is None:
            verb.process.kill()
    print(f"submit ended {ended - cut_at:.1f}s after the cut (exit {code}): {doc.get('error')}")
    assert code == 1, verb.stderr[-3000:]
    assert ended - cut_at <= KEEPALIVE_DEADLINE_S + LOGIN_DEADLINE_S + SLACK_S, (ended - cut_at, verb.stderr[-3000:])
    assert doc["ok"] is False and f"{IP1}: the host stopped answering" in doc["error"]["message"], doc
    assert "unexpected" not in doc["error"]["message"]  # an error of its own, not a crash (--debug shows its trace)
    assert verb.session_alive() == []


def _get(url: str, token: str, timeout: float = 30) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return int(response.status)


def test_dashboard_forward_fails_fast_while_the_link_is_cut_and_answers_again_after(
    lab_hosts: Lab, cluster: str, token: str, ssh_to_head_cut: None
) -> None:
    """As `ssh -L` with ServerAliveInterval, but it does not end: a request while the link is cut fails
    within the keepalive (not a hang); once the link is back the same forward answers again (a new login),
    and Ctrl-C still ends it with 0."""
    with dashboard(cluster) as (process, doc):
        url = doc["url"] + "/api/version"
        assert _get(url, token) == 200
        lab_hosts.sh("lab-h1", CUT)
        cut_at = time.monotonic()
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            _get(url, token, timeout=120)
        failed_in = time.monotonic() - cut_at
        assert failed_in <= KEEPALIVE_DEADLINE_S + LOGIN_DEADLINE_S + SLACK_S, failed_in
        lab_hosts.sh("lab-h1", UNCUT)
        back_at = time.monotonic()

        def answers() -> bool:
            try:
                return _get(url, token) == 200
            except (urllib.error.URLError, ConnectionError, OSError):
                return False

        assert wait_until(answers, 60, 1), "the forward did not answer again after the link came back"
        print(
            f"a request failed {failed_in:.1f}s after the cut; answered again {time.monotonic() - back_at:.1f}s after"
        )
        assert process.poll() is None  # the verb stayed up through it
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0


def test_metrics_with_a_worker_machine_frozen_names_it_and_keeps_the_others(lab_hosts: Lab, cluster: str) -> None:
    """lab-h3 frozen (its sshd and its Ray node's metrics both stop answering): `metrics` ends within its
    scrape deadline, the other targets written and up, lab-h3's target down with the reason."""
    ray = "$(docker ps -q --filter label=io.raycluster.cluster=lab)"
    lab_hosts.sh("lab-h3", f"docker pause {ray}")  # the Ray container of lab-h3's engine (a cgroup of its own)
    try:
        with frozen(lab_hosts, "lab-h3"):
            started = time.monotonic()
            out = str(Path(cluster).parent / "metrics")
            code, doc, err = lab_hosts.cli("metrics", "--out", out, inventory=cluster)
            took = time.monotonic() - started
    finally:
        lab_hosts.sh_result("lab-h3", f"docker unpause {ray}")
    print(f"metrics took {took:.1f}s with lab-h3 frozen: exit {code}; {[t for t in doc.get('targets', [])]}")
    nodes = {t["host"]: t for t in doc["targets"] if t["host"]}
    assert nodes[IP1]["up"] and nodes[IP2]["up"], doc
    assert not nodes[IP3]["up"] and nodes[IP3]["error"], doc
    assert code == 1 and IP3 in str(doc), (code, doc, err[-2000:])
    assert took <= 60, took


FIREWALL = "iptables -{} INPUT -p tcp -m multiport --dports 8080,44217,44227 ! -s {} -j DROP"


def test_the_readmes_firewall_line_lets_only_prometheus_scrape_the_exporter(lab_hosts: Lab, cluster: str) -> None:
    """Issue 34, item 7: Ray 2.60 binds the metrics exporter on every interface (the README says so); the line
    the README gives in answer, with lab-h1 as the Prometheus, keeps this machine out and lets lab-h1 in."""
    listening = lab_hosts.sh("lab-h2", "ss -ltnH 'sport = :8080'")
    assert any(line.split()[3] in ("0.0.0.0:8080", "*:8080", "[::]:8080") for line in listening.splitlines()), listening
    scrape = f"http://{IP2}:8080/metrics"
    with urllib.request.urlopen(scrape, timeout=30) as response:  # this machine, before the line
        assert b"ray_" in response.read()
    head_scrape = (
        "docker exec $(docker ps -q --filter label=io.raycluster.cluster=lab) python -c "
        f"\"import urllib.request; print(len(urllib.request.urlopen('{scrape}', timeout=20).read()))\""
    )
    lab_hosts.sh("lab-h2", FIREWALL.format("I", IP1))
    try:
        with pytest.raises((urllib.error.URLError, TimeoutError, OSError)):
            urllib.request.urlopen(scrape, timeout=5)
        assert int(lab_hosts.sh("lab-h1", head_scrape).strip()) > 0  # Prometheus (lab-h1) still scrapes
    finally:
        lab_hosts.sh_result("lab-h2", FIREWALL.format("D", IP1))
