"""The step anatomy from recorded timelines: each figure read back from a timeline built with it."""

from __future__ import annotations

import pytest

from raycluster_cli.serve.anatomy import step_anatomy


def _pipeline(
    steps: int, compute: list[float], link: float, back: float, engine: float, in_flight: int, wait: float = 0.0
):
    """Steps sent ``in_flight`` at a time through stages of fixed ``compute`` seconds, each hand-off ``link``
    seconds, ``wait`` seconds between the result's arrival and the engine's loop taking it up; the engine sends
    step n when step n - in_flight was handled."""
    records, stages = [], [[] for _ in compute]
    free = [0.0] * len(compute)
    handled: dict[int, float] = {}
    for n in range(steps):
        sent = handled.get(n - in_flight, 0.0)
        ready = sent
        for i, seconds in enumerate(compute):
            start = max(ready, free[i]) + link
            stages[i].append((n, start, start + seconds))
            ready = free[i] = start + seconds
        arrived = ready + back
        came = arrived + wait
        handled[n] = came + engine
        records.append((n, sent, arrived, came, came + engine))
    return records, stages


def test_one_step_at_a_time_shows_each_hand_off_and_the_idle_stages() -> None:
    engine, stages = _pipeline(50, [0.010, 0.020], link=0.003, back=0.004, engine=0.001, in_flight=1)
    found = step_anatomy(engine, stages)
    assert found is not None and found["steps"] == 50
    assert found["round_trip_ms"] == pytest.approx(3 + 10 + 3 + 20 + 4)
    assert [s["compute_ms"] for s in found["stages"]] == pytest.approx([10, 20])
    assert [s["link_ms"] for s in found["stages"]] == pytest.approx([3, 3])
    assert [s["queued_ms"] for s in found["stages"]] == [0, 0]
    # between two steps the 20 ms stage waits for everything else: 40 + 1 - 20 = 21 ms
    assert found["stages"][1]["idle_ms"] == pytest.approx(21)
    assert found["stages"][1]["idle_share"] == pytest.approx(21 / 41, abs=0.01)
    assert found["return_link_ms"] == pytest.approx(4) and found["engine_ms"] == pytest.approx(1)
    assert found["in_flight"] == pytest.approx(1.0)  # one step out whenever any is


def test_enough_steps_in_flight_queue_at_the_slowest_stage_which_never_idles() -> None:
    engine, stages = _pipeline(200, [0.010, 0.020], link=0.003, back=0.004, engine=0.001, in_flight=4)
    found = step_anatomy(engine, stages)
    assert found is not None
    slow = found["stages"][1]
    assert slow["idle_ms"] == pytest.approx(3)  # only its own hand-off, every step
    assert slow["queued_ms"] > 0 and slow["idle_share"] == pytest.approx(3 / 23, abs=0.01)
    assert found["in_flight"] > 3


def test_steps_in_flight_count_only_while_some_step_is_out() -> None:
    engine, stages = _pipeline(20, [0.010, 0.010], link=0.001, back=0.001, engine=0.0, in_flight=2)
    late = [
        (n + 20, s + 100.0, a + 100.0, b + 100.0, h + 100.0) for n, s, a, b, h in engine
    ]  # a second run 100 s later
    later = [[(n + 20, a + 100.0, e + 100.0) for n, a, e in stage] for stage in stages]
    alone = step_anatomy(engine, stages)
    both = step_anatomy(engine + late, [a + b for a, b in zip(stages, later, strict=True)])
    assert alone is not None and both is not None
    assert both["in_flight"] == pytest.approx(alone["in_flight"], abs=0.01) and alone["in_flight"] > 1.5
    # nor do the 100 s between the runs count as the stages' idle time: each run alone idles its stages 0.12 of
    # the time; together 0.15 (the first run's last step going round, while the next run has not begun, counts)
    assert [s["idle_share"] for s in alone["stages"]] == pytest.approx([0.123, 0.123], abs=0.01)
    assert [s["idle_share"] for s in both["stages"]] == pytest.approx([0.147, 0.147], abs=0.01)


def test_only_steps_every_party_remembers_count() -> None:
    engine, stages = _pipeline(20, [0.010, 0.010], link=0.001, back=0.001, engine=0.0, in_flight=1)
    stages[0] = stages[0][5:]  # the first stage forgot its oldest steps
    found = step_anatomy(engine[:-3], stages)
    assert found is not None and found["steps"] == 12
    assert step_anatomy([], stages) is None and step_anatomy(engine, [[], []]) is None


def test_since_keeps_only_the_steps_sent_from_then_on() -> None:
    # a run of one-row steps (10 ms a stage), then a run of heavier ones (30 ms): a benchmark's second run asks for
    # its own steps, which the last 512 the parties remember would mix with the first run's
    light, light_stages = _pipeline(30, [0.010, 0.010], link=0.001, back=0.001, engine=0.0, in_flight=1)
    heavy, heavy_stages = _pipeline(10, [0.030, 0.030], link=0.001, back=0.001, engine=0.0, in_flight=1)
    start = light[-1][4] + 1.0  # the second run begins a second after the first's last step
    engine = light + [(30 + n, s + start, a + start, c + start, h + start) for n, s, a, c, h in heavy]
    stages = [
        first + [(30 + n, a + start, e + start) for n, a, e in second]
        for first, second in zip(light_stages, heavy_stages, strict=True)
    ]
    mixed, own = step_anatomy(engine, stages), step_anatomy(engine, stages, since=start)
    assert mixed is not None and own is not None
    assert mixed["steps"] == 40 and mixed["stages"][0]["compute_ms"] == pytest.approx(10)  # the first run's median
    assert own["steps"] == 10 and own["stages"][0]["compute_ms"] == pytest.approx(30)
    assert step_anatomy(engine, stages, since=engine[-1][1] + 1) is None


def test_the_engine_loops_wait_is_told_apart_from_the_link_back() -> None:
    engine, stages = _pipeline(40, [0.010, 0.010], link=0.001, back=0.002, engine=0.001, in_flight=2, wait=0.006)
    found = step_anatomy(engine, stages, loop_lag=[0.001] * 9 + [0.020])
    assert found is not None
    assert found["return_link_ms"] == pytest.approx(2) and found["engine_wait_ms"] == pytest.approx(6)
    assert found["round_trip_ms"] == pytest.approx(1 + 10 + 1 + 10 + 2 + 6)
    assert found["loop_lag_ms"] == {"p50": pytest.approx(1), "p90": pytest.approx(20)}
    assert step_anatomy(engine, stages)["loop_lag_ms"] is None  # type: ignore[index]


def test_a_stage_slowed_while_another_computes_shows_in_its_alone_and_beside_medians() -> None:
    """Stages that share a machine: the second stage's step takes 12 ms when the first computes meanwhile and
    8 ms when alone.  One step at a time, nothing overlaps; two in flight, the second stage's steps overlap the
    first's next step and the figures tell the two costs apart."""
    engine, stages = _pipeline(40, [0.010, 0.008], link=0.001, back=0.001, engine=0.0, in_flight=1)
    alone = step_anatomy(engine, stages)
    assert alone is not None
    assert [s["beside_share"] for s in alone["stages"]] == [0, 0]
    assert (
        alone["stages"][1]["compute_alone_ms"] == pytest.approx(8) and alone["stages"][1]["compute_beside_ms"] is None
    )

    engine, stages = _pipeline(40, [0.010, 0.008], link=0.001, back=0.001, engine=0.0, in_flight=2)
    first = {n: (a, e) for n, a, e in stages[0]}
    slowed = []
    for n, start, end in stages[1]:  # the stage's step stretched by half wherever stage 0 computes beside it
        overlap = sum(max(0.0, min(e, end) - max(a, start)) for a, e in first.values())
        slowed.append((n, start, end + (0.004 if overlap > 0.5 * (end - start) else 0.0)))
    found = step_anatomy(engine, [stages[0], slowed])
    assert found is not None
    second = found["stages"][1]
    assert second["compute_beside_ms"] == pytest.approx(12) and second["beside_share"] > 0.5
