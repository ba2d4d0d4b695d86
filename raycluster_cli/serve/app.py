"""The Ray Serve application: a FastAPI ingress deployment that speaks the OpenAI API over the pipelines.

Ray Serve owns the HTTP proxy, the ingress's lifecycle and its health checks; this module only maps
routes onto the pool of pipelines (``serve.pool``: why one ingress owns them all and routes itself).
The ingress is constructed only once a real generation went through every stage of its pipelines
(``Engine.probe``), and ``check_health`` repeats that probe on idle pipelines, so "healthy" always
means "generates" (vLLM #53157: a /v1/models that answers while generation is dead).  A pipeline
that dies is replaced by the pool itself; Serve replaces the whole ingress only when no pipeline
came back within ``REBUILD_GRACE_S``.

Everything the deployment class calls is defined above it: ``@serve.deployment`` serializes the
class (and the module globals it names) when it is applied.  No ``from __future__ import annotations`` here: FastAPI reads the route methods' annotations at
runtime, and Serve's ingress wrapper leaves them unresolvable as strings (``Request`` would become
a required query parameter).
"""

import asyncio
import json
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import transformers
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException

from raycluster_cli.apikeys import KeyEntry
from raycluster_cli.models.decoder import config_from_checkpoint
from raycluster_cli.node.gcpause import FullCollections, freeze_heap
from raycluster_cli.placement.pipelines import PipelinePlan
from raycluster_cli.serve import protocol
from raycluster_cli.serve.anatomy import step_anatomy
from raycluster_cli.serve.auth import KeyLimits, ServiceKeys, cluster_token_path
from raycluster_cli.serve.engine import BadInput, EngineDown, Output, QueueFull, RequestFailed
from raycluster_cli.serve.fleet import RayFleet
from raycluster_cli.serve.frontdoor import Tokenizing, check_counts, check_scored, check_text, read_body
from raycluster_cli.serve.frontend import FrontEndCpu
from raycluster_cli.serve.metrics import RayRecorder
from raycluster_cli.serve.pool import Pool, suspect_after_s
from raycluster_cli.serve.protocol import APIError, ChatRequest, CompletionRequest
from raycluster_cli.serve.settings import ServeSettings
from raycluster_cli.serve.text import Sampling, eos_ids, out_of_vocab
from raycluster_cli.serve.tokenbytes import token_bytes

RETRY_AFTER_S = 2
IDLE_PROBE_S = 30.0  # check_health probes with a generation when no step ran for this long
STALL_S = 30.0  # a step in flight this long without any step coming back: a stage is wedged
REBUILD_GRACE_S = 120.0  # no pipeline for this long while rebuilding: Serve replaces the ingress
COUNTERS_S = 10.0  # how long the status route waits for the stages' counters (behind their queued steps)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass
class _Choice:
    """One of a request's ``n`` generations: its first output (awaited before the answer starts), the rest, and
    its log-probabilities' accumulator when asked (holding the echoed prompt's entries from the start)."""

    first: Output
    rest: AsyncIterator[Output]
    logprobs: protocol.Logprobs | None = None


def _choice_body(
    chat: bool, index: int, text: str, reason: str | None, scored: Any, *, delta: bool, first: bool = False
) -> dict[str, Any]:
    if chat:
        return protocol.chat_choice(text, reason, delta=delta, first=first, logprobs=scored, index=index)
    return protocol.completion_choice(text, reason, scored, index=index)


async def _whole(request_id: str, model: str, choices: list[_Choice], *, chat: bool, echo: str = "") -> dict[str, Any]:
    """The whole answer: every choice's text (after the echoed prompt, if asked), finish reason and
    log-probabilities; usage counts the prompt once and every choice's tokens."""

    async def collect(choice: _Choice) -> tuple[str, Output]:
        text, last = echo + choice.first.text, choice.first
        if choice.logprobs is not None:
            choice.logprobs.add(choice.first.logprobs)
        async for out in choice.rest:
            text, last = text + out.text, out
            if choice.logprobs is not None:
                choice.logprobs.add(out.logprobs)
        return text, last

    tasks = [asyncio.ensure_future(collect(c)) for c in choices]
    try:
        done = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # one choice failed (or the client left): the others stop generating for nobody
            task.cancel()
    bodies = [
        _choice_body(chat, i, text, last.finish_reason, c.logprobs.take() if c.logprobs else None, delta=False)
        for i, (c, (text, last)) in enumerate(zip(choices, done, strict=True))
    ]
    kind = "chat.completion" if chat else "text_completion"
    generated = sum(len(last.token_ids) for _, last in done)
    return protocol.envelope(request_id, kind, model, bodies, usage=protocol.usage(done[0][1].prompt_tokens, generated))


async def _merged(choices: list[_Choice]) -> AsyncIterator[tuple[int, Output]]:
    """Every choice's outputs as they come, tagged with its index (one choice: its own, in order).  A choice that
    fails ends the whole stream with its error; leaving early stops every choice's generation."""
    if len(choices) == 1:
        yield 0, choices[0].first
        async for out in choices[0].rest:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, Output | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, choice: _Choice) -> None:
        try:
            await queue.put((index, choice.first))
            async for out in choice.rest:
                await queue.put((index, out))
            await queue.put((index, None))
        except Exception as exc:  # the choice's generation failed: the stream ends with it
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # the client left or a choice failed: the others' generations end (their slots freed)


async def _failing_as_event(
    outputs: AsyncIterator[tuple[int, Output]],
) -> AsyncIterator[tuple[int, Output | dict[str, Any]]]:
    """The outputs, then, if the request failed after its answer began (its own row, or no pipeline left to
    move it to), one error in OpenAI's shape (``{"error": {...}}``, what the ``openai`` client raises from a
    stream) instead of a connection cut without a word."""
    try:
        async for item in outputs:
            yield item
    except (RequestFailed, EngineDown) as exc:
        status = 500 if isinstance(exc, RequestFailed) else 503
        yield 0, APIError(status, f"this request failed: {exc}").body()


async def _stream_events(
    request_id: str,
    model: str,
    choices: list[_Choice],
    *,
    chat: bool,
    include_usage: bool,
    echo: str = "",
) -> AsyncIterator[str]:
    """Server-sent events: each choice's echoed prompt if asked, one chunk per released piece of a choice's text
    (with the log-probabilities of its tokens since its last chunk, if asked; ``index`` names the choice), its
    finish reason, usage if asked (the prompt once, every choice's tokens), [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    last = [c.first for c in choices]
    sent = [0] * len(choices)
    if echo:
        for index, choice in enumerate(choices):  # with the prompt's log-probabilities, when asked
            taken = choice.logprobs.take() if choice.logprobs is not None else None
            body = protocol.completion_choice(echo, None, taken, index=index)
            yield protocol.sse(protocol.envelope(request_id, kind, model, [body]))
    async for index, out in _failing_as_event(_merged(choices)):
        if isinstance(out, dict):  # the stream's error: the client's library raises it
            yield protocol.sse(out)
            yield protocol.sse("[DONE]")
            return
        last[index] = out
        scored = choices[index].logprobs
        if scored is not None:
            scored.add(out.logprobs)
        if not out.text and out.finish_reason is None:
            continue
        taken = scored.take() if scored is not None else None
        body = _choice_body(chat, index, out.text, out.finish_reason, taken, delta=True, first=sent[index] == 0)
        sent[index] += 1
        yield protocol.sse(protocol.envelope(request_id, kind, model, [body]))
    if include_usage:
        generated = sum(len(out.token_ids) for out in last)
        usage = protocol.usage(last[0].prompt_tokens, generated)
        yield protocol.sse(protocol.envelope(request_id, kind, model, [], usage=usage))
    yield protocol.sse("[DONE]")


async def _released(events: Any, release: Any) -> AsyncIterator[Any]:
    try:
        async for event in events:
            yield event
    finally:
        release()


async def _add_counters(
    rows: list[dict[str, Any]], stages: list[list[Any]], engines: list[Any], since: float = 0.0
) -> None:
    """Each pipeline's stages get their counters (steps, busy_s, cpu_s, pid) from the stage actors, and the
    pipeline its step anatomy (``serve.anatomy``: the engine's and the stages' last steps, those sent at ``since``
    or later), all asked at once; a pipeline whose stages do not answer in time gets ``counters_error`` instead."""

    async def one(actors: list[Any]) -> tuple[list[dict[str, Any]], list[Any]]:
        counters = asyncio.gather(*(a.counters.remote() for a in actors))
        timelines = asyncio.gather(*(a.timeline.remote() for a in actors))
        both = await asyncio.wait_for(asyncio.gather(counters, timelines), COUNTERS_S)
        return list(both[0]), list(both[1])

    async def unless_overdue(actors: list[Any], engine: Any) -> tuple[list[dict[str, Any]], list[Any]]:
        # a pipeline whose steps are overdue (a frozen host answers nothing) is not waited for: status stays quick
        if engine.failure is not None or engine.stalled_s() > suspect_after_s(engine):
            raise TimeoutError(f"not asked: no step came back for {engine.stalled_s():.0f} s")
        return await one(actors)

    found = await asyncio.gather(
        *(unless_overdue(actors, engine) for actors, engine in zip(stages, engines, strict=True)),
        return_exceptions=True,
    )
    for row, engine, answer in zip(rows, engines, found, strict=True):
        if isinstance(answer, BaseException):
            row["counters_error"] = f"{type(answer).__name__}: {answer}"
            continue
        counters, timelines = answer
        for stage, values in zip(row.get("stages", []), counters, strict=False):
            stage.update(values)
        row["anatomy"] = step_anatomy(list(engine.recent), timelines, list(engine.loop_lag), since)


# No /docs, /redoc or /openapi.json: the service's surface is OpenAI's API, and nothing answers without a key but
# /health.
app = FastAPI(title="raycluster serve", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(RequestValidationError)
async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(APIError(400, str(exc.errors()[:1])).body(), status_code=400)


@app.exception_handler(HTTPException)
async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0}, health_check_timeout_s=60)
@serve.ingress(app)
class OpenAIServer:
    """One replica: the tokenizer, the stage actors of one pipeline and the engine batching over them."""

    async def __init__(self, settings: ServeSettings) -> None:  # type: ignore[misc]  # Serve awaits it
        self.settings = settings
        self.model_id = settings.served_model
        self.keys = ServiceKeys(settings.keys_file, cluster_token_path())
        self.key_limits = KeyLimits(settings.key_max_requests, settings.key_max_tokens, RETRY_AFTER_S)
        path = Path(settings.model_path)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        self._token_bytes = token_bytes(self.tokenizer)  # a token's own bytes, for log-probability entries
        self.tokenizing = Tokenizing(self.tokenizer, settings.request_limits)
        self.cfg = config_from_checkpoint(path, max_seq=settings.limits.max_seq, dtype=settings.dtype)
        eos = eos_ids(self.tokenizer, _read_json(path / "generation_config.json"))
        fleet = RayFleet(
            self.cfg,
            self.tokenizer,
            settings.limits,
            eos,
            stages=settings.stages,
            speeds=settings.speeds,
            calibration=settings.calibration,
            num_threads=settings.num_threads,
            max_in_flight=settings.max_in_flight,
            links=settings.links,
            unit_bytes=settings.unit_bytes or None,
            stage_fixed_bytes=settings.stage_fixed_bytes,
            model=self.model_id,
        )
        self.pool = Pool(
            fleet,
            failover_wait_s=settings.failover_wait_s,
            replace_period_s=settings.replace_period_s,
            stall_s=STALL_S,
            rebalance_period_s=settings.rebalance_period_s,
            recorder=RayRecorder(),
            model=self.model_id,
        )
        await self._start(settings.pipeline_plans(self.cfg.layers))
        self.created = int(time.time())
        # what the process holds once set up is never collected again: a full collection walks only what came since
        self.collections = FullCollections(freeze_heap())
        self.front_end = FrontEndCpu()

    async def _start(self, plans: list[PipelinePlan]) -> None:
        """Every planned pipeline, built at once; the ones that fail are left to the pool's re-placement
        (their nodes count as free), but with none built the ingress does not start."""
        built = await asyncio.gather(*(self.pool.add(plan) for plan in plans), return_exceptions=True)
        errors = [b for b in built if isinstance(b, BaseException)]
        if len(errors) == len(built):
            raise RuntimeError(f"no pipeline started: {errors[0]!r}")
        self.pool.start()

    async def check_health(self) -> None:
        """Raise when no pipeline generates and none is coming back; probe idle pipelines (a failed probe
        fails that pipeline, which the pool then replaces)."""
        problem = self.pool.health(REBUILD_GRACE_S)
        if problem is not None:
            raise RuntimeError(problem)
        for pipeline in self.pool.live():
            engine = pipeline.engine
            if not engine.live and time.monotonic() - engine.last_step_at > IDLE_PROBE_S:
                try:
                    await engine.probe()
                except Exception as exc:
                    engine.fail(exc)

    def _authorize(self, request: Request) -> KeyEntry:
        return self.keys.authorize(request.headers)

    def _check_model(self, name: str) -> None:
        protocol.check_model(name, self.model_id)

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        return {"object": "list", "data": [protocol.model_card(self.model_id, self.created)]}

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str, request: Request) -> dict[str, Any]:
        self._authorize(request)
        self._check_model(model)
        return protocol.model_card(self.model_id, self.created)

    @app.get("/health")
    async def health(self) -> dict[str, Any]:
        return protocol.health(len(self.pool.live()), RETRY_AFTER_S)

    @app.get("/raycluster/status")
    async def status(self, request: Request) -> dict[str, Any]:
        """The pipelines (split, nodes, state, load, requests served, each stage's counters), the batching
        limits, failovers and recent events; ``now``, this service's wall clock, which a later ``?since=`` gives
        back to have each pipeline's step anatomy over the steps sent from then on (a benchmark's run)."""
        self._authorize(request)
        try:
            since = float(request.query_params.get("since") or 0.0)
        except ValueError:
            raise APIError(400, "since must be a number: a `now` this endpoint gave", param="since") from None
        pipelines = list(self.pool.pipelines)  # the rows' order, taken at the same moment
        body = {
            "model": self.model_id,
            "now": time.time(),
            "limits": asdict(self.settings.limits),
            **self.pool.status(self.cfg.layers),
            "ingress_gc": self.collections.summary(),  # the ingress process's full collections: pauses in every stream
            "front_end": self.front_end.read(),  # CPU seconds of the ingress and of the proxy beside it
            "keys_in_flight": self.key_limits.in_flight(),  # each key's requests and tokens in flight now
        }
        engines = [p.engine for p in pipelines]
        await _add_counters(body["pipelines"], [list(p.stages) for p in pipelines], engines, since)
        return body

    async def _parse(self, request: Request, model: type[Any]) -> Any:
        """The body within its size, parsed, for this model, with its counts within the request limits."""
        limits = self.settings.request_limits
        body = protocol.parse(model, await read_body(request, limits.body_bytes))
        self._check_model(body.model)
        check_counts(body, limits)
        return body

    def _check_ids(self, prompt: list[int], param: str, *, given: bool) -> None:
        """Every token a row of the model's embedding: a client's ids, and the tokenizer's (its vocabulary may
        be larger than the checkpoint's embedding); 400 naming the field, before the request reaches a step."""
        bad = out_of_vocab(prompt, self.cfg.vocab)
        if bad is None:
            return
        last = self.cfg.vocab - 1
        why = (
            f"token {bad} is not in the vocabulary (0-{last})"
            if given
            else (f"the tokenizer gave token {bad}, which the model's embedding (0-{last}) does not have")
        )
        raise APIError(400, f"{param}: {why}", param=param)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        key = self._authorize(request)
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        if isinstance(body.prompt, str):
            check_text(len(body.prompt), self.cfg.max_seq, self.settings.request_limits, "prompt")
            prompt = await self.tokenizing.encode(body.prompt)
        else:
            prompt = [int(t) for t in body.prompt]
        self._check_ids(prompt, "prompt", given=isinstance(body.prompt, list))
        echo = "" if not body.echo else body.prompt if isinstance(body.prompt, str) else self._decode(prompt)
        return await self._answer(body, prompt, chat=False, echo=echo, key=key)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        key = self._authorize(request)
        body: ChatRequest = await self._parse(request, ChatRequest)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        chars = sum(len(m["content"]) for m in messages)
        check_text(chars, self.cfg.max_seq, self.settings.request_limits, "messages")
        prompt = await self.tokenizing.chat(messages)
        self._check_ids(prompt, "messages", given=False)
        return await self._answer(body, prompt, chat=True, key=key)

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    async def _answer(self, body: Any, prompt: list[int], *, chat: bool, key: KeyEntry, echo: str = "") -> Response:
        """Count it against its key (429 over the key's limits), then answer; its count ends with the answer."""
        room = self.settings.limits.max_seq - len(prompt)
        asked = (body.max_completion_tokens if chat else None) or body.max_tokens
        release = self.key_limits.take(key, body.n * (len(prompt) + max(0, asked or room)))
        try:
            response = await self._generate(body, prompt, chat=chat, echo=echo)
        except BaseException:
            release()
            raise
        if isinstance(response, StreamingResponse):  # released when the stream ends, or is dropped unstarted
            response.body_iterator = _released(response.body_iterator, release)
            weakref.finalize(response.body_iterator, release)
        else:
            release()
        return response

    async def _generate(self, body: Any, prompt: list[int], *, chat: bool, echo: str = "") -> Response:
        """Start the generation (errors become 400/503 before any byte is sent), then answer whole or streamed."""
        room = self.settings.limits.max_seq - len(prompt)
        asked = (body.max_completion_tokens if chat else None) or body.max_tokens
        limit = asked or (room if chat else min(16, room))  # OpenAI's default for completions: 16
        if room < 1:
            raise APIError(
                400,
                f"the prompt has {len(prompt)} tokens; the context holds {self.settings.limits.max_seq}",
                param="messages" if chat else "prompt",
            )
        if body.min_tokens > limit:
            raise APIError(400, f"min_tokens {body.min_tokens} is more than max_tokens {limit}", param="min_tokens")
        check_scored(body, len(prompt), self.settings.request_limits)
        biases = body.biases(self.cfg.vocab)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        outputs = [
            self.pool.generate(prompt, limit, self._sampling(body, i, biases), body.stops, stream=body.stream, choice=i)
            for i in range(body.n)
        ]

        async def first(outputs: AsyncIterator[Output]) -> Output:
            return await anext(outputs)

        firsts = await asyncio.gather(*(first(o) for o in outputs), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:  # one choice refused: none is answered (their slots freed now)
            for o in outputs:
                await o.aclose()
            raise self._refusal(failed)
        choices = [
            _Choice(out, rest, self._logprobs(body, chat, echo, prompt, out))
            for out, rest in zip(firsts, outputs, strict=True)
            if isinstance(out, Output)
        ]
        if body.stream:
            events = _stream_events(
                request_id, self.model_id, choices, chat=chat, include_usage=body.include_usage, echo=echo
            )
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            return JSONResponse(await _whole(request_id, self.model_id, choices, chat=chat, echo=echo))
        except (RequestFailed, EngineDown) as exc:  # after its first token: nothing was sent yet
            raise self._refusal(exc) from None

    @staticmethod
    def _sampling(body: Any, index: int, biases: tuple[tuple[int, float], ...] = ()) -> Sampling:
        """Choice ``index``'s sampling: the request's, with ``seed + index`` when seeded (choice i of a seeded
        request is the same answer as a request of n = 1 with that seed)."""
        seed = None if body.seed is None else body.seed + index
        logprobs, prompt = body.asked_logprobs, body.asked_prompt_logprobs
        return Sampling(
            body.temperature,
            body.top_p,
            seed,
            body.ignore_eos,
            logprobs,
            prompt,
            top_k=max(0, body.top_k),
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=biases,
            min_tokens=body.min_tokens,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
        )

    def _logprobs(self, body: Any, chat: bool, echo: str, prompt: list[int], first: Output) -> protocol.Logprobs | None:
        """A choice's log-probabilities' accumulator, None when not asked; an echoed prompt's entries go in first
        (from its first output), so the offsets start at the text's start."""
        if body.asked_logprobs is None:
            return None
        if not body.asked_prompt_logprobs:
            return protocol.Logprobs(self._token_bytes, chat=chat, offset=len(echo))
        scored = protocol.Logprobs(self._token_bytes, chat=chat)
        scored.add_prompt(prompt, first.prompt_logprobs)
        return scored

    @staticmethod
    def _refusal(exc: BaseException) -> BaseException:
        """What a generation that did not start answers: 503 (full, not ready), 400 (too long)."""
        if isinstance(exc, QueueFull):
            return APIError(503, f"the service is full ({exc}); retry later", retry_after=RETRY_AFTER_S)
        if isinstance(exc, EngineDown):
            return APIError(503, f"the service is not ready: {exc}", retry_after=RETRY_AFTER_S)
        if isinstance(exc, RequestFailed):
            return APIError(500, f"this request failed: {exc}")
        if isinstance(exc, BadInput):
            return APIError(400, f"{exc.param}: {exc}", param=exc.param)
        if isinstance(exc, ValueError):
            return APIError(400, str(exc), param="max_tokens")
        return exc


def build_app(settings: ServeSettings, **options: Any) -> Any:
    """The application to ``serve.run``: ``options`` go to the deployment (num_replicas, ray_actor_options). The
    requests the ingress holds and those Ray Serve queues for it are bounded by the settings: past both, Serve's
    proxy answers 503 with Retry-After instead of queueing without end."""
    deployment: Any = OpenAIServer  # a serve.Deployment once decorated; type checkers see the class
    bounds = {"max_ongoing_requests": settings.max_ongoing, "max_queued_requests": settings.max_queued}
    return deployment.options(**(bounds | options)).bind(settings)
