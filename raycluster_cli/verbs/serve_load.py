"""The serving benchmark's load and its statistics: seeded requests, Poisson arrivals, per-request timings from a
streamed answer, each run's percentiles and throughput, and each stage's busy time T_i over the run.

Pure Python (no network): `verbs/serve_bench.py` sends the requests and reads the service's counters; `run_load`
is the loop of one run for text and images alike, over the caller's client. The
figures follow vLLM's `benchmarks/benchmark_serving.py`: TTFT is the time from sending a request to its first
piece of text; TPOT is (end to end − TTFT) / (output tokens − 1), the mean time per token after the first; ITL are
the gaps between successive streamed pieces of one request; throughput counts the tokens the service's `usage`
reports. T_i is the seconds a stage spent inside its forward passes between two reads of its counters.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from raycluster_cli.placement.balance import imbalance, latency_summary, spread, utilisation

# Plain English words: text every tokenizer takes (a byte-level one splits rarer words into more tokens; the
# benchmark measures the service's tokens per word first and sizes prompts from that).
_WORD_TEXT = (
    "the a of to in on at for with by from and or but not is are was were be been cat dog bird fish tree river "
    "hill road town city house door window light dark red green blue small large old new fast slow one two three "
    "four five six seven eight nine ten run walk sing jump read write see hear say think hello world yes no "
    "maybe please thanks story time day night sun moon star sky rain snow wind fire stone"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class RequestSpec:
    """One request of a run: its prompt (``words`` words of text) and the tokens it must generate."""

    index: int
    prompt: str
    words: int
    max_tokens: int


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds (``sent_s`` from the run's start)."""

    index: int
    max_tokens: int
    sent_s: float = 0.0
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    pieces: int = 0  # streamed pieces of text (a piece may hold several tokens' text)
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("itl_s")
        return data | {"tpot_s": self.tpot_s}


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """``"16:64"`` (uniform between, inclusive) or ``"32"`` (always 32) → (low, high)."""
    low, sep, high = text.partition(":")
    try:
        values = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not N or LOW:HIGH (whole numbers)") from None
    if values[0] < 1 or values[1] < values[0]:
        raise ValueError(f"{flag} {text!r}: needs 1 <= LOW <= HIGH")
    return values


def parse_rates(text: str) -> list[float]:
    """``"0.5,1,2"`` → request rates per second (each > 0); "" → none."""
    rates: list[float] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            rate = float(item)
        except ValueError:
            raise ValueError(f"--rates: {item!r} is not a number") from None
        if not rate > 0:
            raise ValueError(f"--rates: {item!r} must be > 0 requests per second")
        rates.append(rate)
    return rates


def make_requests(
    count: int, seed: int, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int], tokens_per_word: float
) -> list[RequestSpec]:
    """``count`` requests with prompt and output lengths drawn uniformly from the ranges (seeded: the same
    seed gives the same requests); a prompt of T tokens is T / ``tokens_per_word`` words of text, rounded
    down (so that, on average, a prompt stays within its range)."""
    rng = random.Random(seed)
    specs = []
    for index in range(count):
        target = rng.randint(*prompt_tokens)
        words = max(1, int(target / max(tokens_per_word, 1e-6)))
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        specs.append(RequestSpec(index, prompt, words, rng.randint(*output_tokens)))
    return specs


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the run's start) of ``count`` requests arriving as a Poisson process of
    ``rate`` per second: exponential gaps of mean 1/rate, the first request at 0."""
    if rate <= 0:
        raise ValueError("the rate must be > 0")
    rng = random.Random(seed)
    times, now = [], 0.0
    for index in range(count):
        if index:
            now += rng.expovariate(rate)
        times.append(now)
    return times


def _summary(values: Sequence[float]) -> dict[str, float | None]:
    return latency_summary(values) | {"mean": sum(values) / len(values) if values else None}


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """One run's figures: counts, throughput over ``wall_s``, p50/p90/p99/mean of TTFT, TPOT, ITL, e2e."""
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    errors: list[str] = sorted({str(r.error) for r in results if r.error})
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors[:5],
        "wall_s": wall_s,
        "requests_per_s": len(done) / wall_s if wall_s > 0 else 0.0,
        "output_tokens": output,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in done),
        "output_tokens_per_s": output / wall_s if wall_s > 0 else 0.0,
        "latency_s": {
            "ttft": _summary([r.ttft_s for r in done if r.ttft_s is not None]),
            "tpot": _summary([t for r in done if (t := r.tpot_s) is not None]),
            "itl": _summary([gap for r in done for gap in r.itl_s]),
            "e2e": _summary([r.e2e_s for r in done if r.e2e_s is not None]),
        },
    }


def stage_rows(status: dict[str, Any]) -> dict[tuple[int, int], dict[str, Any]]:
    """(pipeline index, stage position) → that stage's row of the service's status (its counters in it)."""
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for pipeline in status.get("pipelines", []):
        for position, stage in enumerate(pipeline.get("stages", [])):
            rows[(int(pipeline["index"]), position)] = stage | {"pipeline_state": pipeline.get("state")}
    return rows


def _node_share(was: dict[str, Any], now: dict[str, Any], wall_s: float) -> float | None:
    """CPU seconds the stage's node (its container) used between two reads ÷ (wall × its quota)."""
    used, before, quota = now.get("node_cpu_s"), was.get("node_cpu_s"), now.get("node_cpu_quota")
    if used is None or before is None or not quota or wall_s <= 0:
        return None
    return round((used - before) / (wall_s * quota), 3)


def stage_times(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """Each stage's T_i (busy seconds), steps and CPU seconds between two status reads, and the balance
    figures over them (as `bench` reports them). A stage whose actor changed (its pid: it was rebuilt) counts
    from zero; pipelines that came or went between the reads are named (``pipelines_changed``). ``of_ceiling``: the mean over pipelines of T_max / wall, how close the run came to the pace
    its slowest stage allows (1.0: the bottleneck stage never idled)."""
    old = stage_rows(before)
    stages = []
    for (pipeline, position), now in sorted(stage_rows(after).items()):
        if "busy_s" not in now:
            continue
        was = old.get((pipeline, position), {})
        same = was.get("pid") == now.get("pid") and "busy_s" in was
        stages.append(
            {
                "pipeline": pipeline,
                "stage": position,
                "node_ip": now.get("node_ip", ""),
                "blocks": now.get("blocks"),
                "busy_s": max(0.0, now["busy_s"] - (was["busy_s"] if same else 0.0)),
                "steps": int(now.get("steps", 0)) - (int(was.get("steps", 0)) if same else 0),
                "cpu_s": max(0.0, now.get("cpu_s", 0.0) - (was.get("cpu_s", 0.0) if same else 0.0)),
                # CPU inside forward: the rest of cpu_s is the stage process's other work (Ray's, per call)
                "forward_cpu_s": max(
                    0.0, now.get("forward_cpu_s", 0.0) - (was.get("forward_cpu_s", 0.0) if same else 0.0)
                ),
                # the share of its node's CPU quota the whole node used during the run (None: no quota, or unknown)
                "node_cpu_share": _node_share(was, now, wall_s),
                # seconds its process spent in full garbage collections (its steps waited); None: not counted
                "gc_s": max(0.0, now["gc_s"] - (was.get("gc_s", 0.0) if same else 0.0)) if "gc_s" in now else None,
            }
        )
    for stage in stages:  # CPU per busy second in its forward: its threads when nothing held it back; less when its
        # node's other processes took its quota's share (on a 1.0-CPU head, Ray's own and the front end: ~0.8)
        stage["forward_cpu_per_busy_s"] = (
            round(stage["forward_cpu_s"] / stage["busy_s"], 3) if stage["busy_s"] > 0 else None
        )
    busy = [s["busy_s"] for s in stages]
    peaks = [max(s["busy_s"] for s in stages if s["pipeline"] == p) for p in sorted({s["pipeline"] for s in stages})]
    earlier, later = {p for p, _ in old}, {p for p, _ in stage_rows(after)}
    changed = (
        {"retired": sorted(earlier - later), "new": sorted(later - earlier)} if earlier and earlier != later else None
    )
    return {
        "stages": stages,
        # where a step's time went, per pipeline, over its last steps at the run's end (serve.anatomy)
        "anatomy": {str(p["index"]): p["anatomy"] for p in after.get("pipelines", []) if p.get("anatomy") is not None},
        # pipelines replaced during the run (a re-split, a failover): the retired ones' work is not in T_i
        "pipelines_changed": changed,
        "t_max_minus_t_min_s": spread(busy) if busy else None,
        "imbalance": imbalance(busy) if busy else None,
        "utilisation": utilisation(busy) if busy else None,
        "of_ceiling": sum(peaks) / (len(peaks) * wall_s) if peaks and wall_s > 0 else None,
        "ingress_gc": _ingress_gc(before, after),
    }


def front_end_cpu(before: dict[str, Any], after: dict[str, Any], output_tokens: int = 0) -> dict[str, Any] | None:
    """The CPU seconds the ingress and the proxy beside it (``serve.frontend``) used between two status reads, and
    per output token (ms) when ``output_tokens`` is given; a process that changed between the reads (its pid) or
    that the service does not report is None.  None when the service reports no front end."""
    was, now = before.get("front_end") or {}, after.get("front_end")
    if not now:
        return None
    figures: dict[str, Any] = {}
    for name in ("ingress", "proxy"):
        used, earlier = now.get(f"{name}_cpu_s"), was.get(f"{name}_cpu_s")
        same = was.get(f"{name}_pid") == now.get(f"{name}_pid")
        spent = max(0.0, used - earlier) if used is not None and earlier is not None and same else None
        figures[f"{name}_cpu_s"] = spent
        if output_tokens:
            figures[f"{name}_ms_per_token"] = None if spent is None else round(spent / output_tokens * 1e3, 3)
    return figures


def _ingress_gc(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """The ingress's full garbage collections during the run (a pause in every stream it served): how many, their
    seconds, and the largest pause of the service's last ones (ms); None when the service does not count them."""
    was, now = before.get("ingress_gc"), after.get("ingress_gc")
    if not now:
        return None
    was = was or {}
    return {
        "full_collections": int(now.get("full_collections", 0)) - int(was.get("full_collections", 0)),
        "seconds": max(0.0, float(now.get("total_s", 0.0)) - float(was.get("total_s", 0.0))),
        "max_ms": now.get("max_ms"),
    }


async def run_load(
    client: Any,
    report: Any,
    header: dict[str, Any],
    count: int,
    send_at: list[float] | None,
    concurrency: int,
    one: Callable[[int, float], Awaitable[Any]],
    measure: Callable[[list[Any], float, dict[str, Any], dict[str, Any]], dict[str, Any]],
) -> dict[str, Any]:
    """One run of ``count`` requests: request i sent ``send_at[i]`` seconds after the start (Poisson), or as soon
    as fewer than ``concurrency`` are in flight; ``one(i, sent_s)`` makes it and returns its result (``index``,
    ``to_dict``); the service's counters (``client.status()``) read before and after, and ``measure(results,
    wall, before, after)`` gives the run's figures. What finished stays in ``report.current_results`` if the run
    is interrupted (``report``: serve_bench.ServeBenchReport)."""
    before = await client.status()
    report.current, report.current_results, report.current_began = header, [], time.monotonic()
    gate = asyncio.Semaphore(concurrency or count or 1)
    began = report.current_began

    async def send(index: int) -> None:
        if send_at is not None:
            await asyncio.sleep(max(0.0, began + send_at[index] - time.monotonic()))
        async with gate:
            report.current_results.append(await one(index, time.monotonic() - began))

    await asyncio.gather(*(send(i) for i in range(count)))
    wall = time.monotonic() - began
    now = before.get("now")  # the service's clock: the anatomy after the run is over this run's steps only
    after = await client.status(since=now if isinstance(now, (int, float)) else None)
    results = sorted(report.current_results, key=lambda r: r.index)
    run = header | measure(results, wall, before, after)
    run["per_request"] = [r.to_dict() for r in results]
    report.runs.append(run)
    report.current = None
    return run
