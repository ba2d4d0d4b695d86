"""The Ray backend's re-plans, with the cluster's answers (alive nodes, measured costs) given by the test.

Only ``alive_nodes``, ``answering`` and ``measure`` (what Ray would answer) are replaced; the choices are the
fleet's.  A node in ``cluster.silent`` is one the GCS still lists but that died moments ago: it runs no task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from raycluster_cli.models.config import ModelConfig
from raycluster_cli.placement.partition import blocks_held
from raycluster_cli.placement.pipelines import NodeSpeed, PipelinePlan, plan_replicas
from raycluster_cli.serve import fleet
from raycluster_cli.serve.scheduler import Limits

CFG = ModelConfig(layers=6)


def _speed(name: str, block_s: float = 1.0) -> NodeSpeed:
    return NodeSpeed(name, f"ip-{name}", (0.1, *([block_s] * CFG.layers), 0.1))


def _pipeline(*nodes: str, state: str = "live") -> Any:
    plan = PipelinePlan(tuple(nodes), tuple(f"ip-{n}" for n in nodes), ((0, 4), (4, CFG.num_units))[: len(nodes)])
    return SimpleNamespace(plan=plan, state=state)


class _Cluster(dict[str, str]):
    silent: set[str]
    cuts: set[frozenset[str]]  # pairs of nodes that cannot reach each other (a firewall between two workers)


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> _Cluster:
    alive = _Cluster()
    alive.silent = set()
    alive.cuts = set()

    def fake_measure(cfg: ModelConfig, nodes: dict[str, str], calibration: Any) -> Sequence[NodeSpeed]:
        return [_speed(n, 0.5) for n in nodes]

    monkeypatch.setattr(fleet, "alive_nodes", lambda: dict(alive))
    monkeypatch.setattr(fleet, "measure", fake_measure)
    monkeypatch.setattr(
        fleet, "answering", lambda nodes, *_: {n for n in nodes if n in alive and n not in alive.silent}
    )
    monkeypatch.setattr(fleet, "cuts_among", lambda nodes, *_: {c for c in alive.cuts if c <= set(nodes)})
    return alive


def _fleet() -> fleet.RayFleet:
    speeds = [_speed(n) for n in "abcd"]
    return fleet.RayFleet(CFG, None, Limits(), frozenset(), stages=2, speeds=speeds)


def test_a_dead_node_s_pipeline_is_re_split_over_its_survivor_and_a_free_node(cluster: dict[str, str]) -> None:
    cluster.update({n: f"ip-{n}" for n in "acde"})  # b died; e joined (unmeasured)
    f = _fleet()
    plan = asyncio.run(f.replacement(_pipeline("a", "b"), [_pipeline("c", "d")]))
    assert plan is not None and plan.node_ids == ("a", "e")  # the survivor, then the free node
    assert "e" in f.speeds  # the newcomer was measured


def test_survivors_that_cannot_hold_the_model_are_not_rebuilt_into_a_pipeline(cluster: dict[str, str]) -> None:
    """b dies and no node is free: a alone must hold every unit; with room for half the model it is refused
    (the pool notes the replacement failed) rather than built to be killed for memory; with room, a takes all."""
    from dataclasses import replace

    from raycluster_cli.placement.partition import DoesNotFit

    cluster.update({n: f"ip-{n}" for n in "acd"})
    unit_bytes = [10] * CFG.num_units

    def with_room(room: int) -> fleet.RayFleet:
        speeds = [replace(_speed(n), capacity=room) for n in "abcd"]
        return fleet.RayFleet(CFG, None, Limits(), frozenset(), stages=2, speeds=speeds, unit_bytes=unit_bytes)

    with pytest.raises(DoesNotFit):
        asyncio.run(with_room(40).replacement(_pipeline("a", "b"), [_pipeline("c", "d")]))
    plan = asyncio.run(with_room(1000).replacement(_pipeline("a", "b"), [_pipeline("c", "d")]))
    assert plan is not None and plan.node_ids == ("a",) and plan.ranges == ((0, CFG.num_units),)


def test_a_node_measured_later_gets_its_room_and_the_re_split_keeps_within_it(
    cluster: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """e joins after the launch: it is timed (twice as fast as a) and its room measured; the re-split over a and e
    gives e only what fits its room (25 bytes, less a stage's fixed 5: two units of 10), not the most blocks."""
    from dataclasses import replace

    from raycluster_cli.placement.memory import Capacity

    cluster.update({n: f"ip-{n}" for n in "acde"})  # b died; e joined
    rooms = {"e": 25}
    monkeypatch.setattr(
        fleet, "measure_rooms", lambda ids, *a, **k: [Capacity(n, f"ip-{n}", rooms[n], None, 0, "host") for n in ids]
    )
    speeds = [replace(_speed(n), capacity=1000) for n in "abcd"]
    f = fleet.RayFleet(
        CFG, None, Limits(), frozenset(), stages=2, speeds=speeds, unit_bytes=[10] * CFG.num_units, stage_fixed_bytes=5
    )
    plan = asyncio.run(f.replacement(_pipeline("a", "b"), [_pipeline("c", "d")]))
    assert plan is not None and plan.node_ids == ("a", "e") and f.speeds["e"].capacity == 20
    (start, end) = plan.ranges[1]
    assert end - start <= 2, plan.ranges


def test_a_killed_actor_on_living_nodes_keeps_its_plan(cluster: dict[str, str]) -> None:
    cluster.update({n: f"ip-{n}" for n in "abcd"})
    dead = _pipeline("a", "b")
    assert asyncio.run(_fleet().replacement(dead, [_pipeline("c", "d")])) is dead.plan


def test_a_returning_node_fills_the_degraded_pipeline_then_new_replicas_form(cluster: dict[str, str]) -> None:
    cluster.update({n: f"ip-{n}" for n in "abcd"})
    degraded, full = _pipeline("a"), _pipeline("c", "d")
    changes = asyncio.run(_fleet().growth([degraded, full]))
    assert [(old, plan.node_ids) for old, plan in changes] == [(degraded, ("a", "b"))]
    cluster.update({"e": "ip-e", "f": "ip-f"})
    changes = asyncio.run(_fleet().growth([_pipeline("a", "b"), full]))
    assert [(old, sorted(plan.node_ids)) for old, plan in changes] == [(None, ["e", "f"])]
    assert asyncio.run(_fleet().growth([_pipeline("", "")])) == []  # unpinned pipelines never grow


def test_a_listed_node_that_runs_no_task_is_neither_rebuilt_on_nor_taken_in(cluster: _Cluster) -> None:
    """Seen on the lab: a machine switched off stays in the GCS's list for a while after its pipeline failed; the
    replacement was built on it, and a growth look took it in as a free node."""
    cluster.update({n: f"ip-{n}" for n in "abcd"})
    cluster.silent.add("b")
    plan = asyncio.run(_fleet().replacement(_pipeline("a", "b"), [_pipeline("c")]))
    assert plan is not None and plan.node_ids == ("a", "d")  # b counts as dead: the survivor and the free node
    assert asyncio.run(_fleet().growth([_pipeline("a"), _pipeline("c", "d")])) == []  # b is not taken in
    cluster.silent.clear()
    changes = asyncio.run(_fleet().growth([_pipeline("a"), _pipeline("c", "d")]))
    assert [plan.node_ids for _, plan in changes] == [("a", "b")]  # once it answers, it is


def test_the_launcher_s_measure_splits_by_the_nodes_quotas_not_their_contended_wall_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Session 22 on the 1.0 / 0.5 / 0.25-CPU lab: every node timed at once on shared cores took about the same
    wall clock per block, and the split put 3 of 8 blocks on the 0.25-CPU node.  The same CPU time per block
    on each node, against its quota, must give the fast node the most blocks (here the calibration's answers
    are the test's; the weighing and the split are the launcher's)."""
    cfg = ModelConfig(layers=8)
    quotas = {"fast": 1.0, "mid": 0.5, "slow": 0.25}
    calibration = {
        name: {
            "node_ip": f"ip-{name}",
            "embedding_s": 0.002,
            "block_s": 0.24,  # contended: every node got about the same share of the cores while timed
            "head_s": 0.002,
            "embedding_cpu_s": 0.0005,
            "block_cpu_s": 0.06,
            "head_cpu_s": 0.0005,
            "cpu_quota": quota,
            "num_threads": 1,
            "device": "cpu",
        }
        for name, quota in quotas.items()
    }
    asked: dict[str, Any] = {}
    monkeypatch.setattr(fleet, "node_gpus", lambda: {"fast": 1.0})
    monkeypatch.setattr(fleet, "start_workers", lambda cfg, ids, **kw: asked.update(kw) or list(ids))
    monkeypatch.setattr(fleet, "stop_workers", lambda workers: None)
    monkeypatch.setattr(fleet, "calibrate_workers", lambda workers, *_: [calibration[w] for w in workers])
    speeds = fleet.measure(cfg, {n: f"ip-{n}" for n in quotas}, fleet.Calibration())
    assert [round(s.block_s, 3) for s in speeds] == [0.06, 0.12, 0.24]  # CPU seconds / quota
    assert asked["gpu_nodes"] == {"fast": 1.0}  # timed on the GPU where its stage will run
    (plan,) = plan_replicas(speeds, stages=3)
    blocks = {node: blocks_held(a, b, cfg.layers) for node, (a, b) in zip(plan.node_ids, plan.ranges, strict=True)}
    assert blocks == {"fast": 5, "mid": 2, "slow": 1}, plan
    # a GPU node's work is not its process's CPU time: its wall clock stands
    on_gpu = {**calibration["fast"], "device": "cuda"}
    monkeypatch.setattr(fleet, "calibrate_workers", lambda workers, *_: [on_gpu for _ in workers])
    (gpu,) = fleet.measure(cfg, {"fast": "ip-fast"}, fleet.Calibration())
    assert gpu.block_s == 0.24


class _Counting:
    """A stage actor's ``counters`` as the fleet reads them: steps, busy seconds and CPU seconds inside forward that
    grow between looks, and its node's CPU quota (None: none)."""

    def __init__(self, quota: float | None = None) -> None:
        self.steps, self.busy_s, self.cpu_s, self.quota = 0, 0.0, 0.0, quota
        self.counters = SimpleNamespace(remote=self._remote)

    def run(self, steps: int, seconds_per_step: float, cpu_per_step: float | None = None) -> None:
        self.steps += steps
        self.busy_s += steps * seconds_per_step
        self.cpu_s += steps * (seconds_per_step if cpu_per_step is None else cpu_per_step)

    async def _remote(self) -> dict[str, Any]:
        return {
            "pid": 1, "steps": self.steps, "busy_s": self.busy_s, "forward_cpu_s": self.cpu_s,
            "node_cpu_quota": self.quota,
        }  # fmt: skip


def test_a_stage_under_a_cpu_quota_is_judged_by_its_capacity_time_not_its_bursts(cluster: dict[str, str]) -> None:
    """At a light load the stage on a 0.25-CPU node computes each step in a burst at full speed, so its wall time
    per step looks short; its CPU time over the quota says what a steady load gets.  Judged by that, units move off
    it; by its wall time alone they would move onto it (the look of session 29 that made it the bottleneck)."""
    nodes = [_speed("a"), _speed("b")]
    first = fleet.split_over(nodes)
    a_s, b_s = first.stage_s

    async def judged(quota: float | None) -> PipelinePlan | None:
        fleet_ = fleet.RayFleet(CFG, None, Limits(), frozenset(), stages=2, speeds=nodes)
        stages = [_Counting(), _Counting(quota)]
        old = SimpleNamespace(plan=first, index=0, stages=stages)
        assert await fleet_.rebalance(old) is None  # opens the window
        stages[0].run(100, a_s)
        stages[1].run(100, 0.5 * b_s, cpu_per_step=0.4 * b_s)  # half the wall it was planned, 0.4 of it in CPU
        return await fleet_.rebalance(old)

    def on_b(plan: PipelinePlan) -> int:
        return plan.ranges[1][1] - plan.ranges[1][0]

    burst = asyncio.run(judged(None))  # no quota known: the wall time is all there is, and b looks twice as fast
    assert burst is not None and on_b(burst) > on_b(first)
    steady = asyncio.run(judged(0.25))  # 0.4 / 0.25 = 1.6 x the plan: b is slower than planned, units move off it
    assert steady is not None and on_b(steady) < on_b(first) and "ip-b x1.60" in steady.why


def test_a_re_split_never_goes_back_to_the_split_it_left(cluster: dict[str, str]) -> None:
    """Loaded windows that measure one way, then the other (as rows per step change with the load): the pipeline
    is re-split once, and the look that would take it back to the split it left keeps it."""
    nodes = [_speed("a"), _speed("b")]
    fleet_ = fleet.RayFleet(CFG, None, Limits(), frozenset(), stages=2, speeds=nodes)
    first = fleet.split_over(nodes)  # even costs: 4 units each
    stages = [_Counting(), _Counting()]

    async def look(pipeline: Any, measured: tuple[float, float]) -> PipelinePlan | None:
        for stage, seconds in zip(pipeline.stages, measured, strict=True):
            stage.run(100, seconds)
        return await fleet_.rebalance(pipeline)

    async def scenario() -> tuple[Any, ...]:
        old = SimpleNamespace(plan=first, index=0, stages=stages)
        assert await fleet_.rebalance(old) is None  # the first look only opens the window
        new = await look(old, (2.0 * first.stage_s[0], first.stage_s[1]))  # node a measured twice as slow
        assert new is not None and new.ranges != first.ranges
        again = [_Counting(), _Counting()]
        follower = SimpleNamespace(plan=new, index=1, stages=again)
        assert await fleet_.rebalance(follower) is None
        # now node b is measured the slower one by as much: the min-max split over the corrected costs is the first
        back = await look(follower, (new.stage_s[0], 2.0 * new.stage_s[1]))
        return new, back

    new, back = asyncio.run(scenario())
    assert new.ranges != back  # re-split once (above), then kept
    assert back is None  # not rebuilt into the split it left
    assert first.ranges in fleet_._left[first.node_ids]


class _Pinged:
    """A stage handle whose ``ping`` answers, hangs (its host frozen) or fails (its actor died); ``reach`` says it
    cannot open a connection to the nodes named in ``cut_from``."""

    def __init__(self, how: str, cut_from: Sequence[str] = ()) -> None:
        self.ping = SimpleNamespace(remote=lambda: self._answer(how))
        self.reach = SimpleNamespace(remote=lambda targets: self._reach(targets, cut_from))

    @staticmethod
    async def _reach(targets: list[tuple[str, str, int]], cut_from: Sequence[str]) -> list[str]:
        return [name for name, _, _ in targets if name in cut_from]

    @staticmethod
    async def _answer(how: str) -> int:
        if how == "hangs":
            await asyncio.Event().wait()
        if how == "fails":
            raise RuntimeError("the actor died")
        return 1


@pytest.mark.parametrize(
    ("stages", "said"),
    [
        (("answers", "answers"), None),
        (("answers", "hangs"), "stage 1 on ip-b did not answer within 0 s"),
        (("fails", "hangs"), "stage 0 on ip-a failed to answer: RuntimeError: the actor died"),
    ],
)
def test_a_pipeline_whose_stage_does_not_answer_a_ping_is_named_with_its_node(
    stages: tuple[str, str], said: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fleet, "object_ports", lambda: {n: (f"ip-{n}", 8076) for n in "ab"})
    pipeline = _pipeline("a", "b")
    pipeline.stages = [_Pinged(how) for how in stages]

    async def ask() -> tuple[str | None, int]:
        found = await _fleet().unanswered(pipeline, 0.2)
        await asyncio.sleep(0)  # a cancelled ping's task ends at the loop's next turn
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return found, len(left)

    found, left = asyncio.run(ask())
    assert found == said and left == 0  # a ping that did not answer is not left waiting


def test_stages_that_answer_but_whose_nodes_cannot_reach_each_other_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both stages answer their pings, but b cannot open a connection to a's node (a firewall between two workers):
    the pipeline is reported with the cut, by address; each stage was asked about the other's node only."""
    asked: list[list[str]] = []
    monkeypatch.setattr(fleet, "object_ports", lambda: {n: (f"ip-{n}", 8076) for n in "abc"})
    pipeline = _pipeline("a", "b")
    pipeline.stages = [_Pinged("answers"), _Pinged("answers", cut_from=("a",))]
    for stage in pipeline.stages:
        reach = stage.reach.remote
        stage.reach = SimpleNamespace(
            remote=lambda targets, reach=reach: asked.append([t[0] for t in targets]) or reach(targets)
        )
    found = asyncio.run(_fleet().unanswered(pipeline, 0.2))
    assert found == "its stages' nodes cannot reach each other: ip-a <-> ip-b"
    assert asked == [["b"], ["a"]]


def test_a_cut_between_a_pipeline_s_living_nodes_re_splits_it_over_nodes_that_reach_each_other(
    cluster: _Cluster,
) -> None:
    """a and b both live but cannot reach each other: the replacement is not the same plan (its ring would stall
    again) but the faster of them with the free node c, which reaches it."""
    cluster.update({n: f"ip-{n}" for n in "abc"})
    cluster.cuts = {frozenset("ab")}
    plan = asyncio.run(_fleet().replacement(_pipeline("a", "b"), []))
    assert plan is not None and plan.node_ids == ("a", "c")
    cluster.cuts = set()  # healed: the same plan again
    plan = asyncio.run(_fleet().replacement(_pipeline("a", "b"), []))
    assert plan is not None and plan.node_ids == ("a", "b")


def test_growth_takes_in_no_node_cut_off_from_the_pipeline_it_would_join(cluster: _Cluster) -> None:
    """A degraded pipeline over a; b and c free, b cut off from a: c joins it, b stays out (no replica of its
    own: it is one node of two stages)."""
    cluster.update({n: f"ip-{n}" for n in "abc"})
    cluster.cuts = {frozenset("ab")}
    changes = asyncio.run(_fleet().growth([_pipeline("a")]))
    assert [(old.plan.node_ids if old else None, new.node_ids) for old, new in changes] == [(("a",), ("a", "c"))]
