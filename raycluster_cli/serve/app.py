"""The text service's HTTP shell: the Ray Serve ingress deployment whose routes speak the OpenAI API over an
engine (serve/seam.py; today's is the pool of pipelines, ``serve.pool``: why one ingress owns them all and routes
itself).

The routes parse and check a request (the front door's limits, serve/frontdoor.py; the key, serve/ingress.py),
hand it to the engine, and leave the answer's shape to serve/answers.py and the status's counters to
serve/status.py.  The ingress is constructed only once a real generation went through every stage of its pipelines
(``Engine.probe``), and ``check_health`` repeats that probe on idle pipelines, so "healthy" always means
"generates" (vLLM #53157: a /v1/models that answers while generation is dead).  A pipeline that dies is replaced by
the pool itself; Serve replaces the whole ingress only when no pipeline came back within ``REBUILD_GRACE_S``.

Everything the deployment class calls is defined above it or imported: ``@serve.deployment`` serializes the class
(and the module globals it names) when it is applied.  No ``from __future__ import annotations`` here: FastAPI
reads the route methods' annotations at runtime, and Serve's ingress wrapper leaves them unresolvable as strings
(``Request`` would become a required query parameter).
"""

import asyncio
import json
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import transformers
from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from raycluster_cli.apikeys import KeyEntry
from raycluster_cli.models.decoder import config_from_checkpoint
from raycluster_cli.node.gcpause import FullCollections, freeze_heap
from raycluster_cli.placement.pipelines import PipelinePlan
from raycluster_cli.serve import answers, draining, protocol
from raycluster_cli.serve.answers import RETRY_AFTER_S, Choice
from raycluster_cli.serve.auth import KeyLimits, ServiceKeys, cluster_token_path
from raycluster_cli.serve.engine import EngineDown, Output, RequestFailed
from raycluster_cli.serve.fleet import GcsMarks, RayFleet
from raycluster_cli.serve.frontdoor import Tokenizing, check_counts, check_scored, check_text, read_body
from raycluster_cli.serve.frontend import FrontEndCpu
from raycluster_cli.serve.ingress import KEYED, openai_api, service_key
from raycluster_cli.serve.metrics import RayRecorder
from raycluster_cli.serve.pool import Pool
from raycluster_cli.serve.protocol import APIError, ChatRequest, CompletionRequest
from raycluster_cli.serve.seam import TextEngine
from raycluster_cli.serve.settings import ServeSettings
from raycluster_cli.serve.status import add_counters, since_of
from raycluster_cli.serve.text import eos_ids, out_of_vocab
from raycluster_cli.serve.tokenbytes import token_bytes
from raycluster_cli.serve.vllm_engine import VllmReplicas

IDLE_PROBE_S = 30.0  # check_health probes with a generation when no step ran for this long
STALL_S = 30.0  # a step in flight this long without any step coming back: a stage is wedged
REBUILD_GRACE_S = 120.0  # no pipeline for this long while rebuilding: Serve replaces the ingress


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


app = openai_api("raycluster serve")


@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0}, health_check_timeout_s=60)
@serve.ingress(app)
class OpenAIServer:
    """The text ingress: the tokenizer, the pool of pipelines (each its stage actors and the engine batching over
    them) it routes every request to, the keys, the front door and the status."""

    async def __init__(self, settings: ServeSettings) -> None:  # type: ignore[misc]  # Serve awaits it
        self.settings = settings
        self.model_id = settings.served_model
        self.keys = ServiceKeys(settings.keys_file, cluster_token_path())
        self.key_limits = KeyLimits(settings.key_max_requests, settings.key_max_tokens, RETRY_AFTER_S)
        path = Path(settings.model_path)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        self._token_bytes = token_bytes(self.tokenizer)  # a token's own bytes, for log-probability entries
        self.tokenizing = Tokenizing(self.tokenizer, settings.request_limits)
        self.cfg = replace(
            config_from_checkpoint(path, max_seq=settings.limits.max_seq, dtype=settings.dtype),
            quantize=settings.quantize,
        )
        self.vllm: VllmReplicas | None = None
        if settings.vllm is not None:  # vLLM's servers generate (serve/vllm_engine.py); routes and keys stay ours
            alone = settings.vllm_nodes or (() if settings.vllm_pipelines else ("",))  # none given: one anywhere
            self.vllm = VllmReplicas(settings.vllm, alone, settings.vllm_pipelines)
            await self.vllm.start()
            self.engine: TextEngine = self.vllm
        else:
            self.pool = self._pool(path)
            self.engine = self.pool  # what the routes generate with (serve/seam.py: how a backend plugs in)
            # an ingress started again (its process died) keeps out the nodes drained before it: no plan goes there
            await self._start(await draining.restore(self.pool, settings.pipeline_plans(self.cfg.layers)))
        self.created = int(time.time())
        # what the process holds once set up is never collected again: a full collection walks only what came since
        self.collections = FullCollections(freeze_heap())
        self.front_end = FrontEndCpu()

    def _pool(self, path: Path) -> Pool:
        """Our engine: the pool of pipelines over the stage actors (serve/pool.py)."""
        eos = eos_ids(self.tokenizer, _read_json(path / "generation_config.json"))
        fleet = RayFleet(
            self.cfg,
            self.tokenizer,
            self.settings.limits,
            eos,
            stages=self.settings.stages,
            speeds=self.settings.speeds,
            calibration=self.settings.calibration,
            num_threads=self.settings.num_threads,
            max_in_flight=self.settings.max_in_flight,
            links=self.settings.links,
            unit_bytes=self.settings.unit_bytes or None,
            stage_fixed_bytes=self.settings.stage_fixed_bytes,
            model=self.model_id,
        )
        return Pool(
            fleet,
            failover_wait_s=self.settings.failover_wait_s,
            replace_period_s=self.settings.replace_period_s,
            stall_s=STALL_S,
            rebalance_period_s=self.settings.rebalance_period_s,
            recorder=RayRecorder(),
            model=self.model_id,
            marks=GcsMarks(),
        )

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
        fails that pipeline, which the pool then replaces); with vLLM, its idle replicas generate one token each."""
        if self.vllm is not None:
            await self.vllm.probe(IDLE_PROBE_S)
            if (down := self.vllm.health()) is not None:
                raise RuntimeError(down)
            return
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

    # The operator's calls: methods of the deployment, reached through Ray Serve's handle from the head's container
    # (verbs/drain.py), never HTTP routes: they need the cluster's Ray token or the head itself, not a service key.

    async def drain(self, node: str, deadline_s: float) -> dict[str, Any]:
        """Take ``node`` (a Ray node id or IP) out of the pipelines (serve/draining.py); a refusal as ``refused``."""
        try:
            return (await draining.drain(self.pool, node, deadline_s)).to_dict()
        except (draining.DrainRefused, ValueError) as exc:
            return {"node": node, "refused": str(exc)}

    async def take_in(self, nodes: list[str]) -> dict[str, Any]:
        """Let ``nodes`` back (undrain, or ``up`` started them again) and grow over the nodes no pipeline uses now,
        not at the pool's next periodic look."""
        return await draining.take_in(self.pool, nodes)

    def _check_model(self, name: str) -> None:
        protocol.check_model(name, self.model_id)

    @app.get("/v1/models", dependencies=KEYED)
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [protocol.model_card(self.model_id, self.created)]}

    @app.get("/v1/models/{model:path}", dependencies=KEYED)
    async def model(self, model: str) -> dict[str, Any]:
        self._check_model(model)
        return protocol.model_card(self.model_id, self.created)

    @app.get("/health")
    async def health(self) -> dict[str, Any]:
        live = self.vllm.live() if self.vllm is not None else self.pool.live()
        return protocol.health(len(live), RETRY_AFTER_S)

    @app.get("/raycluster/status", dependencies=KEYED)
    async def status(self, request: Request) -> dict[str, Any]:
        """The pipelines (split, nodes, state, load, requests served, each stage's counters), the batching
        limits, failovers and recent events; ``now``, this service's wall clock, which a later ``?since=`` gives
        back to have each pipeline's step anatomy over the steps sent from then on (a benchmark's run)."""
        since = since_of(request.query_params.get("since"))
        if self.vllm is not None:
            return {"model": self.model_id, "now": time.time(), **self.vllm.status()}
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
        await add_counters(body["pipelines"], pipelines, since)
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

    @app.post("/v1/completions", dependencies=KEYED)
    async def completions(self, request: Request, key: KeyEntry = Depends(service_key)) -> Response:
        body: CompletionRequest = await self._parse(request, CompletionRequest)
        if isinstance(body.prompt, str):
            check_text(len(body.prompt), self.cfg.max_seq, self.settings.request_limits, "prompt")
            prompt = await self.tokenizing.encode(body.prompt)
        else:
            prompt = [int(t) for t in body.prompt]
        self._check_ids(prompt, "prompt", given=isinstance(body.prompt, list))
        echo = "" if not body.echo else body.prompt if isinstance(body.prompt, str) else self._decode(prompt)
        return await self._answer(body, prompt, chat=False, echo=echo, key=key)

    @app.post("/v1/chat/completions", dependencies=KEYED)
    async def chat_completions(self, request: Request, key: KeyEntry = Depends(service_key)) -> Response:
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
            response.body_iterator = answers.released(response.body_iterator, release)
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
            self.engine.generate(
                prompt, limit, answers.sampling(body, i, biases), body.stops, stream=body.stream, choice=i
            )
            for i in range(body.n)
        ]

        async def first(outputs: AsyncIterator[Output]) -> Output:
            return await anext(outputs)

        firsts = await asyncio.gather(*(first(o) for o in outputs), return_exceptions=True)
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:  # one choice refused: none is answered (their slots freed now)
            for o in outputs:
                await o.aclose()
            raise answers.refusal(failed)
        choices = [
            Choice(out, rest, answers.choice_logprobs(self._token_bytes, body, chat, echo, prompt, out))
            for out, rest in zip(firsts, outputs, strict=True)
            if isinstance(out, Output)
        ]
        if body.stream:
            events = answers.stream_events(
                request_id, self.model_id, choices, chat=chat, include_usage=body.include_usage, echo=echo
            )
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            return JSONResponse(await answers.whole(request_id, self.model_id, choices, chat=chat, echo=echo))
        except (RequestFailed, EngineDown) as exc:  # after its first token: nothing was sent yet
            raise answers.refusal(exc) from None


def build_app(settings: ServeSettings, **options: Any) -> Any:
    """The application to ``serve.run``: ``options`` go to the deployment (num_replicas, ray_actor_options). The
    requests the ingress holds and those Ray Serve queues for it are bounded by the settings: past both, Serve's
    proxy answers 503 with Retry-After instead of queueing without end."""
    deployment: Any = OpenAIServer  # a serve.Deployment once decorated; type checkers see the class
    bounds = {"max_ongoing_requests": settings.max_ongoing, "max_queued_requests": settings.max_queued}
    return deployment.options(**(bounds | options)).bind(settings)
