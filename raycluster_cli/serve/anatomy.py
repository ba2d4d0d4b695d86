"""Where a pipeline step's time goes: compute in each stage, the hand-offs between them, queues, the engine.

The engine remembers each step's wall times (sent, back, handled) and each stage its (start, end) of the
same step: the engine sends every step through every stage, and Ray runs one caller's calls to an actor in
order, so the k-th forward of a stage is the engine's k-th step.  From those, per step and stage:

- ``compute``: inside the stage's forward;
- ``queued``: its input was ready but the stage was still busy with the step before;
- ``link``: after both its input was ready and the stage was free, until the forward began: the hand-off
  (Ray's call, the object transfer, a throttled container's wait for its CPU quota);
- ``idle``: the stage's gap between the step before and this one (time the pipeline could have used), only
  while some step was out or being handled (between two benchmark runs, say, nothing was asked of it);
- the last stage's result back to the engine's process (``return_link``: on direct links, until its receive
  thread has it), the wait until the engine's event loop took it up (``engine_wait``: the loop busy with the
  requests' streams, on the head's CPU), and the engine's own work on it (``engine``: sampling, detokenizing);
- ``loop_lag``: how late the engine's event loop ran a timer (p50 and p90 over the last seconds), the same
  loop's congestion seen from outside the steps;
- per stage, ``compute_alone`` and ``compute_beside``: its compute in the steps during which no other stage of
  the pipeline computed (under a tenth of the step) and in those during which another did (over half of it),
  and ``beside_share``, the share of its compute time another stage computed too.  Stages on separate machines
  do not slow each other; stages that share a machine's memory bus or cores (two stages on one host, the lab's
  hosts on one machine) do, and the two medians show by how much.

Medians over the remembered steps, in milliseconds; ``in_flight`` is the mean number of steps travelling
while any was (Little's law: the sum of round trips over the time some step was out; idle gaps between runs
do not count).  Wall clocks of different machines differ by their
NTP offset, which shows in the links between them (not in compute, queued or idle, each read on one clock).
Pure: no Ray here.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

TIMELINE_STEPS = 512  # the steps the engine and each stage remember

EngineRecord = tuple[int, float, float, float, float]  # step number, sent, arrived, back (on the loop), handled
StageRecord = tuple[int, float, float]  # step number, start, end


def _ms(values: list[float]) -> float | None:
    return round(statistics.median(values) * 1000, 3) if values else None


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` as disjoint ones, in order."""
    merged: list[tuple[float, float]] = []
    for begin, finish in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], finish))
        else:
            merged.append((begin, finish))
    return merged


def _busy_span(intervals: list[tuple[float, float]]) -> float:
    """Seconds during which at least one of ``intervals`` was open (the gaps between runs do not count)."""
    return sum(finish - begin for begin, finish in _merged(intervals))


def _within(begin: float, finish: float, merged: list[tuple[float, float]]) -> float:
    """Seconds of [begin, finish] that fall inside the disjoint ``merged`` intervals."""
    index = max(0, bisect.bisect_right(merged, (begin, float("inf"))) - 1)
    total = 0.0
    for low, high in merged[index:]:
        if low >= finish:
            break
        total += max(0.0, min(high, finish) - max(low, begin))
    return total


def _stage_row(figures: Mapping[str, list[float]], beside: float) -> dict[str, Any]:
    """One stage's medians, and the shares of its time idle between steps and computing beside another stage."""
    busy, idle = sum(figures["compute"]), sum(figures["idle"])
    return {f"{name}_ms": _ms(values) for name, values in figures.items()} | {
        "idle_share": round(idle / (idle + busy), 3) if idle + busy > 0 else None,
        "beside_share": round(beside / busy, 3) if busy > 0 else None,
    }


def step_anatomy(
    engine: Sequence[EngineRecord],
    stages: Sequence[Sequence[StageRecord]],
    loop_lag: Sequence[float] = (),
    since: float = 0.0,
) -> dict[str, Any] | None:
    """The medians above over the steps every party still remembers, sent at ``since`` (the engine's wall clock)
    or later: a benchmark's run asks for its own steps, not the run's before it; None when there are none."""
    sent = {n: (s, b, h, a) for n, s, a, b, h in engine if s >= since}
    spans: list[Mapping[int, tuple[float, float]]] = [{n: (a, e) for n, a, e in stage} for stage in stages]
    numbers = sorted(n for n in sent if all(n in span for span in spans))
    if not numbers or not spans:
        return None
    out = _merged([(sent[n][0], sent[n][2]) for n in numbers])  # while some step was out or being handled
    per_stage: list[dict[str, list[float]]] = [
        {"compute": [], "queued": [], "link": [], "idle": [], "compute_alone": [], "compute_beside": []} for _ in spans
    ]
    # each stage's neighbours' compute, merged: how much of a step ran while another stage computed
    computing = [[span[n] for n in numbers] for span in spans]
    others = [_merged([i for j, c in enumerate(computing) if j != index for i in c]) for index in range(len(spans))]
    beside_s = [0.0 for _ in spans]
    return_link: list[float] = []
    engine_wait: list[float] = []
    engine_work: list[float] = []
    round_trips: list[float] = []
    for n in numbers:
        ready = sent[n][0]
        for index, span in enumerate(spans):
            start, end = span[n]
            before = span.get(n - 1)
            free = before[1] if before is not None else ready
            figures = per_stage[index]
            figures["compute"].append(end - start)
            shared = _within(start, end, others[index])
            beside_s[index] += shared
            if end > start and shared < 0.1 * (end - start):
                figures["compute_alone"].append(end - start)
            elif end > start and shared > 0.5 * (end - start):
                figures["compute_beside"].append(end - start)
            figures["queued"].append(max(0.0, free - ready))
            figures["link"].append(max(0.0, start - max(ready, free)))
            if before is not None:
                figures["idle"].append(_within(before[1], start, out))
            ready = end
        return_link.append(max(0.0, sent[n][3] - ready))
        engine_wait.append(max(0.0, sent[n][1] - sent[n][3]))
        engine_work.append(sent[n][2] - sent[n][1])
        round_trips.append(sent[n][1] - sent[n][0])
    span_s = _busy_span([(sent[n][0], sent[n][1]) for n in numbers])
    stage_rows = [_stage_row(figures, beside) for figures, beside in zip(per_stage, beside_s, strict=True)]
    return {
        "steps": len(numbers),
        "round_trip_ms": _ms(round_trips),
        "in_flight": round(sum(round_trips) / span_s, 2) if span_s > 0 else None,
        "stages": stage_rows,
        "return_link_ms": _ms(return_link),
        "engine_wait_ms": _ms(engine_wait),
        "engine_ms": _ms(engine_work),
        "loop_lag_ms": _lag(loop_lag),
    }


def _lag(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {
        "p50": round(ordered[len(ordered) // 2] * 1000, 3),
        "p90": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))] * 1000, 3),
    }
