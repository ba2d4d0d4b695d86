"""`bench --serve`: the running service `serve` deployed, benchmarked from the operator's machine.

Requests go to the service's OpenAI API as a client would send them (`/v1/completions`, streamed, the cluster's
token as the key), from one event loop (transport/http.py): a run at each Poisson rate, then a saturation run
(every request at once, or at most ``concurrency`` in flight). Output lengths are fixed by ``max_tokens`` with
``ignore_eos`` (the service's extension, as vLLM's), prompts are plain words sized from the service's own count
of tokens per word; greedy unless ``temperature`` (and ``top_p``) are given. Before and after each run the
service's `/raycluster/status` gives every stage's counters (steps, seconds inside forward, CPU seconds), so each
run reports T_i per node. Any other OpenAI-compatible service (vLLM, to compare engines on one load) has no such
page (404): its model and context then come from `/v1/models`, and its runs have no stage figures.
Statistics: verbs/serve_load.py.
The report fills in as runs end: a caller that is interrupted still holds what was measured. An image service
(its status says ``kind: image``) gets the same runs of images instead (verbs/serve_images_bench.py). Never prints.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raycluster_cli.apikeys import check_key
from raycluster_cli.config.inventory import Inventory
from raycluster_cli.errors import OperationError, UsageError
from raycluster_cli.progress import Progress, quiet
from raycluster_cli.transport import http
from raycluster_cli.verbs import serve_keys
from raycluster_cli.verbs.serve_images_bench import run_image_bench, summarize_images
from raycluster_cli.verbs.serve_load import (
    WORDS,
    RequestResult,
    RequestSpec,
    front_end_cpu,
    make_requests,
    poisson_arrivals,
    run_load,
    stage_times,
    summarize,
)


@dataclass(frozen=True)
class ServiceTarget:
    """Where the service answers (its base URL, ``…/v1``), its key (None: no auth) and, for https, the
    certificate it is verified with (None: the system's CAs alone)."""

    url: str
    token: str | None
    cert: Path | None = None

    @property
    def root(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")


@dataclass(frozen=True)
class LoadPlan:
    rates: tuple[float, ...] = (0.5, 1.0, 2.0)
    requests: int = 32  # per run
    saturation: bool = True
    concurrency: int = 0  # saturation run: requests in flight at most (0: all at once)
    prompt_tokens: tuple[int, int] | None = None  # None: 1/16 .. 1/4 of the service's context
    output_tokens: tuple[int, int] | None = None
    seed: int = 0
    request_timeout_s: float = 300.0
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0


@dataclass
class ServeBenchReport:
    """What the benchmark measured so far; ``runs`` grows as each run ends (``current``: the one under way)."""

    url: str = ""
    model: str = ""
    max_seq: int = 0
    workload: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, Any]] = field(default_factory=list)
    current: dict[str, Any] | None = None
    current_results: list[Any] = field(default_factory=list)  # RequestResult; ImageResult for images
    current_began: float = 0.0

    def to_dict(self, interrupted: bool = False) -> dict[str, Any]:
        runs = list(self.runs)
        if interrupted and self.current is not None:  # the run under way: what finished before the interrupt
            wall = time.monotonic() - self.current_began
            image = self.workload.get("kind") == "image"
            partial = self.current | (summarize_images if image else summarize)(self.current_results, wall)
            runs.append(partial | {"interrupted": True, "per_request": [r.to_dict() for r in self.current_results]})
        return {
            "url": self.url,
            "model": self.model,
            "max_seq": self.max_seq,
            "workload": self.workload,
            "runs": runs,
            "interrupted": interrupted,
        }


def target_of(
    inventory: Inventory, service: dict[str, Any] | None, url: str = "", key_file: str = "", ca_file: str = ""
) -> ServiceTarget:
    """The service's URL (``url`` when given, else the launcher's record), the service's default key made on this
    machine (``serve`` made it; never the cluster's Ray token), and its certificate when it speaks https."""
    record = (service or {}).get("record") or {}
    found = url or str(record.get("url") or "")
    if not found:
        raise OperationError(
            f"cluster {inventory.cluster} serves nothing", "start it: raycluster serve --model-path DIR"
        )
    cert = Path(ca_file) if ca_file else serve_keys.service_cert(inventory)
    if key_file:
        try:
            return ServiceTarget(found, check_key(Path(key_file).read_text(), key_file), cert)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--api-key-file {key_file}: {exc}", "a file holding one API key") from None
    key = serve_keys.read_key(inventory)
    if key is None:
        raise OperationError(
            f"this machine has no key for cluster {inventory.cluster}'s service ({serve_keys.key_file(inventory)})",
            "run the benchmark where `serve` ran, or give this machine a key: raycluster serve --keys add NAME",
        )
    return ServiceTarget(found, key, cert)


class ServiceClient:
    """The calls the benchmark makes, each under its own deadline."""

    def __init__(self, target: ServiceTarget, timeout_s: float, sampling: dict[str, float] | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.sampling = sampling or {"temperature": 0.0}
        self.counters = True  # False: the service has no /raycluster/status (another OpenAI-compatible service)
        self.headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
        self.tls = serve_keys.client_context(target.cert)

    async def status(self, since: float | None = None) -> dict[str, Any]:
        """The service's status; with ``since`` (a ``now`` it gave) its step anatomy covers the steps from then.
        ``{}`` from a service without the page (404: not raycluster's), and from then on without asking again."""
        if not self.counters:
            return {}
        url = f"{self.target.root}/raycluster/status" + (f"?since={since!r}" if since is not None else "")
        async with http.request(
            "GET", url, timeout_s=min(self.timeout_s, 60.0), headers=self.headers, tls=self.tls
        ) as answer:
            body = await _json_or_text(answer)
        if answer.status == 404:
            self.counters = False
            return {}
        if answer.status != 200 or not isinstance(body, dict):
            raise OperationError(f"{url}: HTTP {answer.status}: {_message(body)}", _hint(answer.status))
        return body

    async def model_card(self) -> tuple[str, int]:
        """The first model `/v1/models` lists and its context (vLLM's ``max_model_len``; 0 when not given)."""
        url = f"{self.target.url.rstrip('/')}/models"
        async with http.request(
            "GET", url, timeout_s=min(self.timeout_s, 60.0), headers=self.headers, tls=self.tls
        ) as a:
            body = await _json_or_text(a)
        if a.status != 200 or not isinstance(body, dict) or not body.get("data"):
            raise OperationError(f"{url}: HTTP {a.status}: {_message(body)}", _hint(a.status))
        card = body["data"][0]
        return str(card["id"]), int(card.get("max_model_len") or 0)

    async def prompt_tokens(self, model: str, prompt: str) -> int:
        """The service's token count of ``prompt`` (one generated token, not streamed)."""
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        url = f"{self.target.url.rstrip('/')}/completions"
        async with http.request(
            "POST", url, timeout_s=self.timeout_s, json_body=body, headers=self.headers, tls=self.tls
        ) as a:
            answer = await a.json()
        if a.status != 200:
            raise OperationError(f"{url}: HTTP {a.status}: {_message(answer)}", _hint(a.status))
        return int(answer["usage"]["prompt_tokens"])

    async def image(self, model: str, prompt: str, seed: int) -> tuple[int, Any]:
        """One image (the service's size and steps), as its HTTP status and JSON body."""
        body = {"model": model, "prompt": prompt, "n": 1, "response_format": "b64_json", "seed": seed}
        url = f"{self.target.url.rstrip('/')}/images/generations"
        async with http.request(
            "POST", url, timeout_s=self.timeout_s, json_body=body, headers=self.headers, tls=self.tls
        ) as a:
            return a.status, await _json_or_text(a)

    async def stream(self, model: str, spec: RequestSpec, result: RequestResult) -> None:
        """Send one streamed completion; fill ``result`` with what the client saw and when."""
        body = {
            "model": model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            **self.sampling,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        url = f"{self.target.url.rstrip('/')}/completions"
        began = time.monotonic()
        last = began
        async with http.request(
            "POST", url, timeout_s=self.timeout_s, json_body=body, headers=self.headers, tls=self.tls
        ) as a:
            if a.status != 200:
                result.error = f"HTTP {a.status}: {_message(await _json_or_text(a))}"
                return
            async for line in a.lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    result.prompt_tokens = int(event["usage"]["prompt_tokens"])
                    result.output_tokens = int(event["usage"]["completion_tokens"])
                if any(choice.get("text") for choice in event.get("choices") or []):
                    now = time.monotonic()
                    if result.ttft_s is None:
                        result.ttft_s = now - began
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    result.pieces += 1
        result.e2e_s = time.monotonic() - began
        if result.output_tokens == 0:
            result.output_tokens = result.pieces  # no usage event: each piece counted as a token


async def _json_or_text(answer: http.Response) -> Any:
    raw = await answer.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw[:200].decode("utf-8", "replace")


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", body["error"]))
    return str(body)[:200]


def _hint(status: int) -> str:
    if status == 401:
        return "the service refused this machine's key: is it this cluster's service? (raycluster serve --keys list)"
    return "raycluster status shows the service; raycluster serve --model-path DIR restarts it"


async def _one(client: ServiceClient, model: str, spec: RequestSpec, result: RequestResult) -> None:
    try:
        await client.stream(model, spec, result)
    except (TimeoutError, http.HTTPFailure, OSError, ValueError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _run(
    client: ServiceClient,
    report: ServeBenchReport,
    header: dict[str, Any],
    specs: list[RequestSpec],
    send_at: list[float] | None,
    concurrency: int,
) -> dict[str, Any]:
    """One run of ``specs`` (serve_load.run_load); the stages' busy times from their counters."""
    by_index = {spec.index: spec for spec in specs}

    async def one(index: int, sent_s: float) -> RequestResult:
        spec = by_index[index]
        result = RequestResult(spec.index, spec.max_tokens, sent_s=sent_s)
        await _one(client, report.model, spec, result)
        return result

    def measure(results: list[Any], wall: float, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
        figures = summarize(results, wall) | stage_times(before, after, wall)
        # the head's CPU outside the stages for each token: what a head that also holds a stage gives up
        figures["front_end"] = front_end_cpu(before, after, int(figures.get("output_tokens") or 0))
        return figures

    return await run_load(client, report, header, len(specs), send_at, concurrency, one, measure)


def _lengths(given: tuple[int, int] | None, max_seq: int) -> tuple[int, int]:
    return given or (max(1, max_seq // 16), max(1, max_seq // 4))


async def run_serve_bench(
    target: ServiceTarget, plan: LoadPlan, report: ServeBenchReport, progress: Progress = quiet
) -> ServeBenchReport:
    """Every run of ``plan`` against the service; ``report`` fills in as they end."""
    sampling = {"temperature": plan.temperature} | ({"top_p": plan.top_p} if plan.top_p < 1 else {})
    client = ServiceClient(target, plan.request_timeout_s, sampling)
    status = await client.status()
    report.url, report.model = target.url, str(status.get("model", ""))
    if status.get("kind") == "image":  # an image service: images/s and seconds per image (serve_images_bench)
        return await run_image_bench(client, plan, report, status, progress)
    report.max_seq = int((status.get("limits") or {}).get("max_seq", 0))
    if not client.counters:  # another OpenAI-compatible service: its model card says what status would
        report.model, report.max_seq = await client.model_card()
    prompt, output = _lengths(plan.prompt_tokens, report.max_seq), _lengths(plan.output_tokens, report.max_seq)
    if report.max_seq and prompt[1] + output[1] > report.max_seq:
        raise UsageError(
            f"--prompt-tokens {prompt[0]}:{prompt[1]} and --output-tokens {output[0]}:{output[1]} can exceed the "
            f"service's context of {report.max_seq} tokens",
            f"keep the two highs' sum <= {report.max_seq} (or serve with a larger --max-seq)",
        )
    progress("measuring the service's tokens per word (one request)")
    probe = WORDS[: max(1, min(len(WORDS), (report.max_seq or 64) // 4))]  # the words prompts are made of
    per_word = await client.prompt_tokens(report.model, " ".join(probe)) / len(probe)
    report.workload = {
        "requests_per_run": plan.requests,
        "prompt_tokens": list(prompt),
        "output_tokens": list(output),
        "tokens_per_word": per_word,
        "seed": plan.seed,
        "ignore_eos": True,
        "sampling": sampling,
        "stage_counters": client.counters,
    }
    for number, rate in enumerate(plan.rates):
        specs = make_requests(plan.requests, plan.seed + number, prompt, output, per_word)
        progress(f"Poisson run at {rate:g} requests/s: {plan.requests} requests")
        times = poisson_arrivals(plan.requests, rate, plan.seed + number)
        await _run(client, report, {"kind": "poisson", "rate": rate}, specs, times, 0)
    if plan.saturation:
        specs = make_requests(plan.requests, plan.seed + len(plan.rates), prompt, output, per_word)
        progress(f"saturation run: {plan.requests} requests, {plan.concurrency or 'all'} at once")
        header = {"kind": "saturation", "concurrency": plan.concurrency or plan.requests}
        await _run(client, report, header, specs, None, plan.concurrency)
    return report


def run_blocking(
    target: ServiceTarget,
    plan: LoadPlan,
    report: ServeBenchReport,
    progress: Progress = quiet,
    timeout_s: float = 3600.0,
) -> ServeBenchReport:
    """``run_serve_bench`` on its own event loop, the whole benchmark under ``timeout_s``."""

    async def bounded() -> ServeBenchReport:
        try:
            return await asyncio.wait_for(run_serve_bench(target, plan, report, progress), timeout_s)
        except TimeoutError:
            raise OperationError(
                f"the serving benchmark passed its --timeout of {timeout_s:g} s",
                "give it longer (--timeout), fewer --requests or fewer --rates",
            ) from None

    return asyncio.run(bounded())
