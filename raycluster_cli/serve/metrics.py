"""The service's own Prometheus metrics: what its clients get and what its pipelines do, beside Ray's.

Ray Serve exports its HTTP proxy's and replicas' metrics (requests, latencies, errors) through each node's metrics
agent, which `raycluster metrics` points Prometheus at.  Those count HTTP requests; a model service is judged in
tokens: time to first token, time per output token, tokens generated, requests running and waiting, KV slots in
use, failovers, and each stage's busy time (which shows how even the split is).  These are recorded here with
``ray.util.metrics``, so they leave through the same agents with no port of their own (Ray prefixes their names
with ``ray_``; a counter gets ``_total``): the ingress records the request and pipeline figures, each stage actor
its own busy seconds and steps (tagged with its pipeline, stage and node address); an image service its
requests, images and seconds per request, and its live replicas.

Recording goes through a ``Recorder``: ``RayRecorder`` in the service, ``MemoryRecorder`` in tests.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("raycluster.serve")
COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
TTFT_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BOUNDS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
E2E_BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0)
STAGE_FLUSH_S = 1.0  # how often a stage adds its busy seconds and steps to its counters


@dataclass(frozen=True)
class Metric:
    kind: str
    description: str
    tags: tuple[str, ...]
    bounds: tuple[float, ...] = ()


METRICS: dict[str, Metric] = {
    "raycluster_serve_requests": Metric(
        COUNTER,
        "Requests ended, by why: stop, length, error (failed), refused (full, too long), abort (client gone)",
        ("model", "finish_reason"),
    ),
    "raycluster_serve_prompt_tokens": Metric(COUNTER, "Prompt tokens of the requests ended", ("model",)),
    "raycluster_serve_generation_tokens": Metric(COUNTER, "Tokens generated for the requests ended", ("model",)),
    "raycluster_serve_time_to_first_token_seconds": Metric(
        HISTOGRAM, "From the request's arrival at the ingress to its first token", ("model",), TTFT_BOUNDS
    ),
    "raycluster_serve_time_per_output_token_seconds": Metric(
        HISTOGRAM, "A request's time after its first token over its other tokens", ("model",), TPOT_BOUNDS
    ),
    "raycluster_serve_e2e_request_latency_seconds": Metric(
        HISTOGRAM, "From the request's arrival to its last token", ("model",), E2E_BOUNDS
    ),
    "raycluster_serve_failovers": Metric(COUNTER, "Requests moved to another pipeline when theirs failed", ("model",)),
    "raycluster_serve_requests_running": Metric(
        GAUGE, "Requests holding a KV slot on a pipeline", ("model", "pipeline")
    ),
    "raycluster_serve_requests_waiting": Metric(
        GAUGE, "Requests waiting for a KV slot on a pipeline", ("model", "pipeline")
    ),
    "raycluster_serve_kv_slots_used_ratio": Metric(
        GAUGE, "Share of a pipeline's KV cache slots in use", ("model", "pipeline")
    ),
    "raycluster_serve_kv_tokens_used_ratio": Metric(
        GAUGE, "Share of a pipeline's KV cache budget in tokens held by running sequences", ("model", "pipeline")
    ),
    "raycluster_serve_outstanding_tokens": Metric(
        GAUGE, "Prompt tokens still to prefill and tokens still to generate on a pipeline", ("model", "pipeline")
    ),
    "raycluster_serve_replicas_live": Metric(GAUGE, "Pipelines taking requests", ("model",)),
    "raycluster_serve_image_requests": Metric(
        COUNTER, "Image requests ended, by outcome: ok, refused (full, not ready), error", ("model", "outcome")
    ),
    "raycluster_serve_images": Metric(COUNTER, "Images made", ("model",)),
    "raycluster_serve_image_request_seconds": Metric(
        HISTOGRAM, "An image request's time from its arrival to its images made", ("model",), E2E_BOUNDS
    ),
    "raycluster_serve_stage_busy_seconds": Metric(
        COUNTER, "Seconds a stage spent computing steps", ("model", "pipeline", "stage", "node_ip")
    ),
    "raycluster_serve_stage_steps": Metric(
        COUNTER, "Steps a stage computed", ("model", "pipeline", "stage", "node_ip")
    ),
}


class Recorder(Protocol):
    def record(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        """Add ``value`` to a counter, observe it in a histogram, or set a gauge to it (by ``METRICS[name]``)."""
        ...


class MemoryRecorder:
    """Keeps every recorded value, by metric and tags: what the unit tests read."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = defaultdict(list)

    def record(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        metric = METRICS[name]
        assert set(tags) == set(metric.tags), (name, tags)
        assert value >= 0, (name, value)  # counters grow, gauges and times are never negative
        self.values[(name, tuple(sorted(tags.items())))].append(value)

    def total(self, name: str, **tags: str) -> float:
        """A counter's sum over every series whose tags include ``tags``."""
        return sum(sum(v) for (n, t), v in self.values.items() if n == name and set(tags.items()) <= set(t))

    def observed(self, name: str, **tags: str) -> list[float]:
        return [x for (n, t), v in self.values.items() if n == name and set(tags.items()) <= set(t) for x in v]

    def last(self, name: str, **tags: str) -> float | None:
        found = [v[-1] for (n, t), v in self.values.items() if n == name and set(tags.items()) <= set(t)]
        return found[-1] if found else None


class RayRecorder:
    """``ray.util.metrics`` objects, each made on its first use in this process (they register with its core
    worker, so they must be made where they are recorded: in the ingress, in each stage actor)."""

    def __init__(self) -> None:
        self._made: dict[str, Any] = {}
        self._failed: set[str] = set()  # metrics whose recording failed once (said once in the log)
        self._lock = threading.Lock()  # a stage records from its links thread and from Ray's

    def record(self, name: str, value: float, tags: Mapping[str, str]) -> None:
        """Never raises: a figure that cannot be recorded must not fail the request or step it describes."""
        metric = METRICS[name]
        if metric.kind == COUNTER and value <= 0:  # Ray's counters take only positive increments
            return
        try:
            with self._lock:
                made = self._made.get(name) or self._make(name)
            if metric.kind == COUNTER:
                made.inc(value, tags=dict(tags))
            elif metric.kind == GAUGE:
                made.set(value, tags=dict(tags))
            else:
                made.observe(value, tags=dict(tags))
        except Exception as exc:
            if name not in self._failed:
                self._failed.add(name)
                log.warning("serve: the metric %s could not be recorded: %s: %s", name, type(exc).__name__, exc)

    def _make(self, name: str) -> Any:
        from ray.util import metrics

        metric = METRICS[name]
        made: Any
        if metric.kind == COUNTER:
            made = metrics.Counter(name, metric.description, tag_keys=metric.tags)
        elif metric.kind == GAUGE:
            made = metrics.Gauge(name, metric.description, tag_keys=metric.tags)
        else:
            made = metrics.Histogram(name, metric.description, boundaries=list(metric.bounds), tag_keys=metric.tags)
        self._made[name] = made
        return made


class RequestTimer:
    """One request's figures from its arrival: first token, tokens, how it ended; recorded once, when it ends.
    A request of ``n`` choices is ``n`` generations: each records its tokens and latencies, and only the first
    (``counted``) the request and its prompt tokens, as the answer's ``usage`` counts the prompt once."""

    def __init__(self, recorder: Recorder | None, model: str, prompt_tokens: int, counted: bool = True) -> None:
        self.recorder, self.model, self.prompt_tokens, self.counted = recorder, model, prompt_tokens, counted
        self.began = time.monotonic()
        self.first_at: float | None = None
        self.tokens = 0
        self.done = False

    def output(self, tokens: int) -> None:
        """An output was produced with ``tokens`` generated so far."""
        if self.first_at is None and tokens > 0:
            self.first_at = time.monotonic()
        self.tokens = max(self.tokens, tokens)

    def end(self, finish_reason: str) -> None:
        if self.done or self.recorder is None:
            self.done = True
            return
        self.done = True
        now, tags, record = time.monotonic(), {"model": self.model}, self.recorder.record
        if self.counted:
            record("raycluster_serve_requests", 1, {**tags, "finish_reason": finish_reason})
            record("raycluster_serve_prompt_tokens", self.prompt_tokens, tags)
        record("raycluster_serve_generation_tokens", self.tokens, tags)
        if self.first_at is not None:
            record("raycluster_serve_time_to_first_token_seconds", self.first_at - self.began, tags)
            record("raycluster_serve_e2e_request_latency_seconds", now - self.began, tags)
            if self.tokens > 1:
                record(
                    "raycluster_serve_time_per_output_token_seconds", (now - self.first_at) / (self.tokens - 1), tags
                )


class StageMeter:
    """Adds a stage's steps and busy seconds to its counters every ``flush_s``, on a thread of its own, from the
    running totals the stage already keeps (``totals``: steps, busy seconds): nothing is added to a step's path."""

    def __init__(
        self,
        recorder: Recorder,
        tags: Mapping[str, str],
        totals: Callable[[], tuple[int, float]],
        flush_s: float = STAGE_FLUSH_S,
    ) -> None:
        self.recorder, self.tags, self.totals, self.flush_s = recorder, dict(tags), totals, flush_s
        self._flushed = (0, 0.0)  # the totals already added

    def start(self) -> None:
        threading.Thread(target=self._flushing, name="stage-metrics", daemon=True).start()

    def flush(self) -> None:
        steps, busy = self.totals()
        if steps > self._flushed[0]:
            self.recorder.record("raycluster_serve_stage_busy_seconds", busy - self._flushed[1], self.tags)
            self.recorder.record("raycluster_serve_stage_steps", steps - self._flushed[0], self.tags)
        self._flushed = (steps, busy)

    def _flushing(self) -> None:
        while True:
            time.sleep(self.flush_s)
            with contextlib.suppress(Exception):  # a metrics agent that refuses must not end the stage
                self.flush()


def image_request(recorder: Recorder, model: str, outcome: str, images: int, seconds: float) -> None:
    """One image request ended: its outcome, and for one that made its images, how many and how long it took."""
    recorder.record("raycluster_serve_image_requests", 1, {"model": model, "outcome": outcome})
    if outcome == "ok":
        recorder.record("raycluster_serve_images", images, {"model": model})
        recorder.record("raycluster_serve_image_request_seconds", seconds, {"model": model})


def pipeline_gauges(recorder: Recorder, model: str, pipelines: list[Any], gone: list[int], live: int) -> None:
    """Each pipeline's requests running and waiting, KV slots in use and outstanding tokens; ``gone``: the
    indexes of pipelines removed since the last call, set to 0 (a gauge keeps its last value); ``live``: the
    pipelines taking requests."""
    for pipeline in pipelines:
        scheduler = pipeline.engine.scheduler
        tags = {"model": model, "pipeline": str(pipeline.index)}
        slots = scheduler.limits.slots
        recorder.record("raycluster_serve_requests_running", len(scheduler.running), tags)
        recorder.record("raycluster_serve_requests_waiting", len(scheduler.waiting), tags)
        recorder.record("raycluster_serve_kv_slots_used_ratio", (slots - len(scheduler.free_slots)) / slots, tags)
        budget = scheduler.limits.kv_budget
        recorder.record("raycluster_serve_kv_tokens_used_ratio", scheduler.kv_used_tokens / budget, tags)
        recorder.record("raycluster_serve_outstanding_tokens", scheduler.outstanding, tags)
    for index in gone:
        tags = {"model": model, "pipeline": str(index)}
        for name in (
            "raycluster_serve_requests_running",
            "raycluster_serve_requests_waiting",
            "raycluster_serve_kv_slots_used_ratio",
            "raycluster_serve_kv_tokens_used_ratio",
            "raycluster_serve_outstanding_tokens",
        ):
            recorder.record(name, 0, tags)
    recorder.record("raycluster_serve_replicas_live", live, {"model": model})
