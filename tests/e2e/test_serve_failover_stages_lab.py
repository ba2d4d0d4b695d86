"""`serve --stages 3` on the real 3-host lab: one pipeline whose ring crosses every host loses a worker under load,
then gets it back (issue 52, items 4: "a 3-stage pipeline over 3 hosts losing a worker under load").

The one-stage failover test (test_serve_failover_lab.py) never cuts a ring across hosts: its survivors are whole
replicas.  Here the only pipeline runs a stage on each host, so losing lab-h3 (`docker kill` of the host container,
as a power cut) stops every request at once; the pool must re-split the model over the two survivors
(``RayFleet.replacement`` → ``placement.replan``), build that pipeline on real hosts, and continue each stream from
the tokens it sent.  No request fails, every answer equals `transformers`' `generate()`, and within 60 s of the
kill the service serves from a two-stage pipeline over lab-h1 and lab-h2.  The host boots again, `up` tells the
service, and the degraded pipeline is rebuilt over all three hosts (``RayFleet.growth``), still under load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from .conftest import IP1, IP2, IP3, Lab
from .faults import power_off, power_on, wait_until
from .test_serve_failover_lab import (
    CLIENTS,
    DEAD,
    PROMPTS,
    RAY_CONTAINER,
    RECOVERY_LIMIT_S,
    RETURN_LIMIT_S,
    Load,
    Served,
    pipeline_ips,
    serve_tiny,
)

pytestmark = [pytest.mark.lab, pytest.mark.slow]


@pytest.fixture(scope="module")
def served(lab_hosts: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    code, _, err = lab_hosts.cli("up", timeout=1500)
    assert code == 0, err
    try:
        yield serve_tiny(lab_hosts, tmp_path_factory.mktemp("stages"), stages=3, replicas=1)
    finally:
        lab_hosts.cli("serve", "--stop", timeout=300)


def _over(served: Served, hosts: set[str]) -> bool:
    """One live pipeline, its stages on exactly ``hosts`` (one each), and nothing else live."""
    try:
        live = pipeline_ips(served.status())
    except OSError:
        return False
    return len(live) == 1 and len(live[0]) == len(hosts) and set(live[0]) == hosts


def test_a_worker_lost_from_a_three_stage_ring_fails_no_request_and_the_ring_is_whole_again(served: Served) -> None:
    lab = served.lab
    assert _over(served, {IP1, IP2, IP3}), served.status()["pipelines"]
    with Load(served) as load:
        assert wait_until(lambda: len(load.answers) >= 2 * CLIENTS, 300), load.errors
        killed, killed_wall = time.monotonic(), time.time()
        power_off(lab, DEAD)
        assert wait_until(lambda: _over(served, {IP1, IP2}), RECOVERY_LIMIT_S, step=0.5), served.status()["events"]
        resplit_s = time.monotonic() - killed
        fresh = PROMPTS[5]
        assert asyncio.run(served.complete(fresh, stream=False)) == served.want(fresh)
        before = len(load.answers)
        assert wait_until(lambda: len(load.answers) >= before + 3 * CLIENTS, 300), load.errors
        lost = served.status()
        answered_lost = len(load.answers)

        power_on(lab, DEAD)
        code, _, err = lab.cli("up", timeout=900)
        assert code == 0, err[-3000:]
        up_done = time.monotonic()
        assert wait_until(lambda: _over(served, {IP1, IP2, IP3}), RETURN_LIMIT_S, step=0.5), served.status()["events"]
        back_s = time.monotonic() - up_done
        before = len(load.answers)
        assert wait_until(lambda: len(load.answers) >= before + 3 * CLIENTS, 300), load.errors

    events: list[dict[str, Any]] = [e for e in served.status()["events"] if e["at"] >= killed_wall]
    print(
        f"\n[3 stages] kill -> two-stage pipeline serving {resplit_s:.1f} s; `up` -> three stages again"
        f" {back_s:.1f} s; {answered_lost} answers by then, {len(load.answers)} in all, {len(load.errors)} errors;"
        f" events {[(e['event'], e.get('detail', '')) for e in events]}"
    )
    assert load.errors == [] and load.wrong() == []
    names = [e["event"] for e in events]
    assert "failed" in names and "failover" in names, events  # the ring was cut with requests on it, and they moved
    assert resplit_s < RECOVERY_LIMIT_S
    # the survivors hold the whole model between them: units cut at one point, from the embedding to the head
    units = [s["units"] for p in lost["pipelines"] if p["state"] == "live" for s in p["stages"]]
    whole = [s["units"] for s in served.status()["pipelines"][-1]["stages"]]
    assert len(units) == 2 and units[0][0] == 0 and units[0][1] == units[1][0] and units[1][1] == whole[-1][1], units
    assert "grown" in names, events  # the degraded pipeline taken back to three stages by the returned host


def _cut(lab: Lab, one: str, other: str, *, heal: bool = False) -> None:
    """Every packet between lab hosts ``one`` and ``other`` dropped (both ways, on ``one``), each still reaching
    the head; ``heal`` takes the rules out again."""
    flag = "-D" if heal else "-I"
    ip = lab.host(other).address
    lab.sh(one, f"iptables {flag} INPUT -s {ip} -j DROP && iptables {flag} OUTPUT -d {ip} -j DROP")


def _stage_order(served: Served) -> list[str]:
    (ips,) = pipeline_ips(served.status())
    return ips


def test_a_cut_between_two_workers_moves_the_service_onto_nodes_that_reach_each_other(served: Served) -> None:
    """lab-h2 and lab-h3 stop reaching each other (iptables on lab-h3, both ways), each still answering the head.
    When they are neighbours in the ring, its steps stop: every stage answers its ping, so the pool asks whether
    the stages' nodes reach each other, and fails the pipeline naming the cut.  When the head's stage sits between
    them, the ring runs on; a stage process on a worker is then killed so the pipeline must be rebuilt.  Either
    way the replacement is planned over nodes that all reach each other (the head and one worker: two stages), no
    request fails, every answer is greedy, and while the cut lasts the pool's look does not take the other worker
    back.  Healed, the pipeline grows over all three again."""
    lab = served.lab
    assert wait_until(lambda: _over(served, {IP1, IP2, IP3}), 120), served.status()["pipelines"]
    order = _stage_order(served)
    neighbours = abs(order.index(IP2) - order.index(IP3)) == 1
    with Load(served) as load:
        assert wait_until(lambda: len(load.answers) >= 2 * CLIENTS, 300), load.errors
        cut, cut_wall = time.monotonic(), time.time()
        _cut(lab, "lab-h3", "lab-h2")
        try:
            if not neighbours:  # the ring does not cross the cut: a rebuild must
                lab.sh("lab-h2", f"docker exec {RAY_CONTAINER} pkill -9 -f ray::_StageActor")
            two = lambda: _over(served, {IP1, IP2}) or _over(served, {IP1, IP3})  # noqa: E731
            assert wait_until(two, RECOVERY_LIMIT_S, step=0.5), served.status()["events"]
            moved_s = time.monotonic() - cut
            fresh = PROMPTS[4]
            assert asyncio.run(served.complete(fresh, stream=False)) == served.want(fresh)
            before = len(load.answers)
            # a whole look of the pool (30 s) with the cut still there: the other worker is not taken back
            time.sleep(35)
            assert wait_until(lambda: len(load.answers) >= before + 3 * CLIENTS, 300), load.errors
            assert two(), served.status()["pipelines"]
        finally:
            _cut(lab, "lab-h3", "lab-h2", heal=True)
        healed = time.monotonic()
        assert wait_until(lambda: _over(served, {IP1, IP2, IP3}), RETURN_LIMIT_S, step=1), served.status()["events"]
        back_s = time.monotonic() - healed
    events = [(e["event"], e.get("detail", "")) for e in served.status()["events"] if e["at"] >= cut_wall]
    print(
        f"\n[cut h2-h3] ring {order}, neighbours {neighbours}: two stages serving {moved_s:.1f} s after the cut;"
        f" healed -> three stages {back_s:.1f} s; {len(load.answers)} answers, {len(load.errors)} errors; {events}"
    )
    assert load.errors == [] and load.wrong() == []
    failed = [detail for name, detail in events if name == "failed"]
    assert failed, events
    if neighbours:
        assert "cannot reach each other" in failed[0] and IP2 in failed[0] and IP3 in failed[0], failed
    assert moved_s < RECOVERY_LIMIT_S


def test_a_second_worker_lost_while_the_first_is_repaired_leaves_the_head_serving_alone(served: Served) -> None:
    """lab-h3 is switched off under load; once the pool has failed its pipeline and while it repairs it (its
    requests waiting for the replacement), lab-h2 is switched off too.  The repair must not build on the second
    lost host: the head alone holds the model and serves.  No request fails, every answer is greedy; both hosts
    back and `up`, the ring is three stages again."""
    lab = served.lab
    assert wait_until(lambda: _over(served, {IP1, IP2, IP3}), 120), served.status()["pipelines"]
    with Load(served) as load:
        assert wait_until(lambda: len(load.answers) >= 2 * CLIENTS, 300), load.errors
        killed, killed_wall = time.monotonic(), time.time()
        power_off(lab, DEAD)

        def repairing() -> bool:
            return any(e["event"] == "failed" and e["at"] >= killed_wall for e in served.status()["events"])

        assert wait_until(repairing, RECOVERY_LIMIT_S, step=0.2), served.status()["events"]
        power_off(lab, "lab-h2")
        second = time.monotonic()
        assert wait_until(lambda: _over(served, {IP1}), 2 * RECOVERY_LIMIT_S, step=0.5), served.status()["events"]
        alone_s = time.monotonic() - second
        fresh = PROMPTS[6]
        assert asyncio.run(served.complete(fresh, stream=False)) == served.want(fresh)
        before = len(load.answers)
        assert wait_until(lambda: len(load.answers) >= before + 2 * CLIENTS, 300), load.errors

        power_on(lab, DEAD)
        power_on(lab, "lab-h2")
        code, _, err = lab.cli("up", timeout=900)
        assert code == 0, err[-3000:]
        assert wait_until(lambda: _over(served, {IP1, IP2, IP3}), RETURN_LIMIT_S, step=1), served.status()["events"]
        before = len(load.answers)
        assert wait_until(lambda: len(load.answers) >= before + 2 * CLIENTS, 300), load.errors
    events = [(e["event"], e.get("detail", "")[:120]) for e in served.status()["events"] if e["at"] >= killed_wall]
    print(
        f"\n[second failure] h2 lost {second - killed:.1f} s after h3, during the repair; the head alone serving"
        f" {alone_s:.1f} s after; {len(load.answers)} answers, {len(load.errors)} errors; {events}"
    )
    assert load.errors == [] and load.wrong() == []
