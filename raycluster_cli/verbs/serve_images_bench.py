"""`bench --serve` against an image service: images/s and seconds per image as its clients see them.

The runs are the text benchmark's (a run at each Poisson rate, then a saturation run), each request one image
(``n`` = 1, ``b64_json``) of the service's own size and steps, with prompts of plain words and seeds ``seed + i``,
so a run repeats.  Each answer is checked to be one PNG.  Before and after each run the service's
`/raycluster/status` gives each replica's images made and each actor's busy seconds, so a run reports T_i per node,
its imbalance and each replica's share (a replica 4× faster should make ~4× the images under saturation).

Pure functions over a client the caller owns (verbs/serve_bench.py: its HTTP client, deadlines and token), so
this module imports nothing of it.  Never prints.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from raycluster_cli.placement.balance import imbalance, latency_summary, spread, utilisation
from raycluster_cli.verbs.serve_load import WORDS, poisson_arrivals, run_load

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class ImageResult:
    index: int
    seed: int
    sent_s: float = 0.0
    e2e_s: float | None = None
    png_bytes: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e_s is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def prompt_of(index: int, seed: int) -> str:
    """A prompt of 3 to 8 plain words, fixed by the request's index and the run's seed."""
    count = 3 + (index * 7 + seed) % 6
    return " ".join(WORDS[(index * 13 + seed * 5 + j * 11) % len(WORDS)] for j in range(count))


def check_answer(status: int, body: Any) -> tuple[int, str | None]:
    """(PNG bytes, error): one image, base64 of a PNG, or why not."""
    if status != 200 or not isinstance(body, dict):
        message = body.get("error", {}).get("message", body) if isinstance(body, dict) else body
        return 0, f"HTTP {status}: {str(message)[:200]}"
    data = body.get("data") or []
    if len(data) != 1 or not isinstance(data[0], dict) or not data[0].get("b64_json"):
        return 0, f"HTTP 200 without one b64_json image ({len(data)} item(s))"
    try:
        raw = base64.b64decode(data[0]["b64_json"], validate=True)
    except (binascii.Error, ValueError):
        return 0, "the b64_json is not base64"
    if not raw.startswith(PNG_SIGNATURE):
        return 0, "the image is not a PNG"
    return len(raw), None


def summarize_images(results: Sequence[ImageResult], wall_s: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    per_s = len(done) / wall_s if wall_s > 0 else 0.0
    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({str(r.error) for r in results if r.error})[:5],
        "wall_s": wall_s,
        "images_per_s": per_s,
        "requests_per_s": per_s,
        "latency_s": {"e2e": latency_summary([r.e2e_s for r in done if r.e2e_s is not None])},
    }


def _actors(status: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(str(n.get("node_id", n.get("node_ip"))), "+".join(n.get("parts", []))): n for n in status.get("nodes", [])}


def replica_times(before: dict[str, Any], after: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """Between two status reads: each replica's images, each actor's busy seconds T_i and calls, the balance."""
    old = _actors(before)
    stages = []
    for key, now in sorted(_actors(after).items()):
        was = old.get(key, {})
        stages.append(
            {
                "node_ip": now.get("node_ip", ""),
                "parts": now.get("parts", []),
                "busy_s": max(0.0, float(now.get("busy_s", 0.0)) - float(was.get("busy_s", 0.0))),
                "calls": int(now.get("calls", 0)) - int(was.get("calls", 0)),
            }
        )
    made_before = {p["index"]: p.get("served", 0) for p in before.get("pipelines", [])}
    replicas = [
        {
            "index": p["index"],
            "state": p.get("state"),
            "s_per_image": p.get("s_per_image"),
            "images": int(p.get("served", 0)) - int(made_before.get(p["index"], 0)),
            "node_ips": [s.get("node_ip", "") for s in p.get("stages", [])],
        }
        for p in after.get("pipelines", [])
    ]
    busy = [s["busy_s"] for s in stages]
    return {
        "replicas": replicas,
        "stages": stages,
        "t_max_minus_t_min_s": spread(busy) if len(busy) > 1 else None,
        "imbalance": imbalance(busy) if len(busy) > 1 else None,
        "utilisation": utilisation(busy) if busy else None,
    }


async def run_images(
    client: Any,
    report: Any,
    header: dict[str, Any],
    count: int,
    seed: int,
    send_at: list[float] | None,
    concurrency: int,
) -> dict[str, Any]:
    """One run of ``count`` images (serve_load.run_load; ``client``: serve_bench.ServiceClient); each replica's
    busy time from its counters."""

    async def one(index: int, sent_s: float) -> ImageResult:
        result = ImageResult(index, seed + index, sent_s=sent_s)
        started = time.monotonic()
        try:
            status, body = await client.image(report.model, prompt_of(index, seed), seed + index)
            result.png_bytes, result.error = check_answer(status, body)
            result.e2e_s = time.monotonic() - started
        except (TimeoutError, OSError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return result

    def measure(results: list[Any], wall: float, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        return summarize_images(results, wall) | replica_times(before, after, wall)

    return await run_load(client, report, header, count, send_at, concurrency, one, measure)


async def run_image_bench(client: Any, plan: Any, report: Any, status: dict[str, Any], progress: Any) -> Any:
    """Every run of ``plan`` (serve_bench.LoadPlan) against the image service whose status is ``status``."""
    calibration = status.get("calibration") or {}
    report.workload = {
        "kind": "image",
        "requests_per_run": plan.requests,
        "size": calibration.get("size"),
        "steps": calibration.get("steps"),
        "replicas": status.get("replicas"),
        "placement": status.get("why", ""),
        "seed": plan.seed,
    }
    for number, rate in enumerate(plan.rates):
        progress(f"Poisson run at {rate:g} images/s: {plan.requests} images")
        times = poisson_arrivals(plan.requests, rate, plan.seed + number)
        seed = plan.seed + 1000 * number
        await run_images(client, report, {"kind": "poisson", "rate": rate}, plan.requests, seed, times, 0)
    if plan.saturation:
        progress(f"saturation run: {plan.requests} images, {plan.concurrency or 'all'} at once")
        header = {"kind": "saturation", "concurrency": plan.concurrency or plan.requests}
        seed = plan.seed + 1000 * len(plan.rates)
        await run_images(client, report, header, plan.requests, seed, None, plan.concurrency)
    return report
