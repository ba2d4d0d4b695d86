"""Operating a running fleet on the real 3-host lab (issue 52, item 3): a host added with `up`, drained under load,
taken out with `down --host`, and brought back, while the service answers.

The service starts on two hosts (an inventory without lab-h3), one one-stage replica each.  `up` with the full
inventory starts lab-h3 and keeps the two others running, and the service takes lab-h3 in as a third replica before
`up` returns (not at its 30 s periodic look).  Under a steady load of the real `openai` client, `raycluster drain
IP3` builds nothing (the two others serve), stops routing to lab-h3's replica and lets its streams finish: no
request fails, every answer is `transformers`' greedy one.  `down --host IP3` removes lab-h3's container only;
`status` lists it as drained; `up` starts it again and the service lets it back at once.  `drain --undo` is checked
on lab-h2 the same way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import IP2, IP3, Lab
from .faults import wait_until
from .test_serve_failover_lab import CLIENTS, PROMPTS, Load, Served, pipeline_ips, serve_tiny

pytestmark = [pytest.mark.lab, pytest.mark.slow]

DRAIN_LIMIT_S = 60.0  # the target: the node idle within its deadline
INGRESS_BACK_S = 180.0  # Serve's health check finds the replica dead, starts another, which builds its pipelines
INGRESS_TITLE = "ServeReplica:raycluster:OpenAIServer"  # the ingress's process title (Ray's ray::<actor>)
RAY_CONTAINER = "$(docker ps -q --filter label=io.raycluster.cluster=lab)"  # on a lab host, its Ray node


def _without_h3(lab: Lab, path: Path) -> str:
    def edit(data: dict[str, Any]) -> None:
        data["hosts"] = [h for h in data["hosts"] if str(h["address"]) != IP3]

    return lab.variant(path, edit)


@pytest.fixture(scope="module")
def served(lab_hosts: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    lab_hosts.cli("down", timeout=600)
    two = _without_h3(lab_hosts, tmp_path_factory.mktemp("inv") / "two.yaml")
    code, _, err = lab_hosts.cli("up", inventory=two, timeout=1500)
    assert code == 0, err
    try:
        yield serve_tiny(lab_hosts, tmp_path_factory.mktemp("drain"), stages=1, replicas=2, inventory=two)
    finally:
        lab_hosts.cli("serve", "--stop", timeout=300)


def _up_adds_h3(served: Served) -> None:
    code, doc, err = served.lab.cli("up", timeout=1500)
    assert code == 0, err
    actions = {n["host"]: n["action"] for n in doc["nodes"]}
    assert actions[IP3] == "started" and [a for h, a in actions.items() if h != IP3] == ["running", "running"]
    assert doc["service_grown"], doc  # the service built on it before `up` returned
    assert [IP3] in pipeline_ips(served.status())


def _drain_under_load(served: Served, host: str) -> dict[str, Any]:
    with Load(served) as load:
        assert wait_until(lambda: len(load.answers) >= 2 * CLIENTS, 300), load.errors
        began = time.monotonic()
        code, doc, err = served.lab.cli("drain", host, "--deadline", str(DRAIN_LIMIT_S), timeout=900)
        took = time.monotonic() - began
        before = len(load.answers)
        assert wait_until(lambda: len(load.answers) >= before + 2 * CLIENTS, 300), load.errors
    print(f"\n[drain] {host}: {doc} in {took:.1f} s; {len(load.answers)} answers, {len(load.errors)} errors")
    assert code == 0, err
    assert load.errors == [] and load.wrong() == []
    assert doc["host"] == host and doc["drained"] and doc["moved"] == 0 and doc["seconds"] < DRAIN_LIMIT_S
    assert all(host not in ips for ips in pipeline_ips(served.status()))
    return doc


def test_a_host_added_drained_taken_out_and_back_fails_no_request(served: Served) -> None:
    _up_adds_h3(served)
    _drain_under_load(served, IP3)
    code, doc, err = served.lab.cli("down", "--host", IP3, timeout=600)
    assert code == 0, err
    assert [r["host"] for r in doc["removed"]] == [IP3] and doc["drained"]["host"] == IP3
    code, status, _ = served.lab.cli("status", timeout=300)
    assert IP3 in [d["node"] for d in status["service"]["live"]["drained"]]
    assert {h["host"]: h["container"] for h in status["hosts"]}[IP2] == "running"  # the rest untouched
    code, doc, err = served.lab.cli("up", timeout=1500)
    assert code == 0 and doc["service_grown"], err
    assert [IP3] in pipeline_ips(served.status()) and served.status()["drained"] == []


def _ingress_killed(served: Served) -> dict[str, Any]:
    """The ingress's process on the head killed (SIGKILL, in the head's Ray container): the status of the ingress
    Serve starts in its place, once it answers."""
    old = served.status()["front_end"]["ingress_pid"]
    served.lab.sh("lab-h1", f"docker exec {RAY_CONTAINER} pkill -9 -f {INGRESS_TITLE}")
    began = time.monotonic()

    def restarted() -> dict[str, Any] | None:
        try:
            status = served.status()
        except OSError:  # the proxy answers 503 (or nothing) while no ingress runs
            return None
        return status if status["front_end"]["ingress_pid"] != old and pipeline_ips(status) else None

    assert wait_until(lambda: restarted() is not None, INGRESS_BACK_S), "no new ingress answered"
    status = restarted()
    assert status is not None
    print(f"\n[ingress killed] a new one served {pipeline_ips(status)} after {time.monotonic() - began:.1f} s")
    return status


def test_drain_undo_lets_a_host_back_at_once(served: Served) -> None:
    _drain_under_load(served, IP2)
    # the ingress dies while IP2 is drained: the one Serve starts again reads the mark, and the launcher's plan of a
    # replica on IP2 is not built (the mark was only in the dead process's memory before)
    status = _ingress_killed(served)
    assert [d["node"] for d in status["drained"]] == [IP2], status["drained"]
    assert all(IP2 not in ips for ips in pipeline_ips(status)), pipeline_ips(status)
    answer = asyncio.run(served.complete(PROMPTS[0], stream=True))
    assert answer == served.want(PROMPTS[0])
    code, doc, err = served.lab.cli("drain", "--undo", IP2, timeout=900)
    assert code == 0 and doc["action"] == "undrained" and doc["grown"], (doc, err)
    assert [IP2] in pipeline_ips(served.status())
