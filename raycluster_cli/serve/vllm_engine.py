"""vLLM replicas behind our ingress (``--engine vllm``): a ``TextEngine`` (serve/seam.py) whose generations run
on vLLM servers, one per chosen node, each started and reached through its ``VllmServer`` actor (node/vllm_server.py).

Our ingress keeps everything in front of the seam: the routes, the keys and their limits, the front door, the
tokenizer and chat template, the answer's shape.  A generation is sent to vLLM as token ids (``prompt``: the ids
our tokenizer made, so both engines see the same tokens) with the request's sampling under vLLM's own names, and
comes back as text and token ids (``return_token_ids``), whole or as the server streams it.  Requests go to the
replica with the fewest outstanding (the replicas may be unequal nodes; the late-bound choice the image service
makes).  A replica whose call fails before anything was sent is taken out and the request tried on another; one
that fails mid-stream ends that stream with the error.  Log-probabilities are not forwarded yet: refused (400).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raycluster_cli.node.vllm_server import VllmGone, VllmLaunch, VllmRank, VllmRefused, VllmServer
from raycluster_cli.serve.live import BadInput, EngineDown, Output, RequestFailed
from raycluster_cli.serve.text import Sampling

CALL_SLACK_S = 30.0  # beyond the request's own deadline, for Ray to carry the answer back


def completion_body(
    model: str, prompt: list[int], max_tokens: int, sampling: Sampling, stop: list[str] | None
) -> dict[str, Any]:
    """A request's /v1/completions body for vLLM: the prompt's token ids and the sampling under vLLM's names."""
    if sampling.logprobs is not None or sampling.prompt_logprobs:
        raise BadInput("logprobs are not forwarded to --engine vllm yet: leave logprobs unset", "logprobs")
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "min_p": sampling.min_p,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "ignore_eos": sampling.ignore_eos,
        "min_tokens": sampling.min_tokens,
        "skip_special_tokens": sampling.skip_special_tokens,
        "spaces_between_special_tokens": sampling.spaces_between_special_tokens,
        "include_stop_str_in_output": sampling.include_stop_str_in_output,
        "return_token_ids": True,
    }
    if sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if sampling.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias}
    if stop:
        body["stop"] = list(stop)
    return body


@dataclass
class Replica:
    """One vLLM server (with a pipeline's headless ranks on the nodes after its own) and what the ingress knows."""

    node_id: str
    actor: Any
    ranks: list[Any] = field(default_factory=list)  # the headless ranks' actors, stage 1 on
    outstanding: int = 0
    failure: str | None = None
    started: dict[str, Any] | None = None
    last_used: float = 0.0  # when a request or a probe last reached it (monotonic)


class VllmReplicas:
    """The vLLM servers of one service behind one ``generate``: one per node of ``node_ids`` ("" = anywhere), and
    one pipeline over each group of ``pipelines`` (stage i on its node i; ``launch.env`` carries the split)."""

    def __init__(self, launch: VllmLaunch, node_ids: Sequence[str], pipelines: Sequence[Sequence[str]] = ()) -> None:
        self.launch = launch
        self.replicas = [Replica(node, self._actor(node)) for node in node_ids]
        for group in pipelines:
            self.replicas.append(Replica(group[0], self._actor(group[0]), [self._actor(n) for n in group[1:]]))
        self.served = 0

    def _actor(self, node_id: str) -> Any:
        options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1000}
        if node_id:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        return ray.remote(VllmServer).options(**options).remote(self.launch)

    async def _start(self, replica: Replica) -> dict[str, Any]:
        """One replica: its server, or a pipeline's headless ranks and then its rank 0 (whose first generation
        went through every stage), all stopped when it fails."""
        if not replica.ranks:
            started: dict[str, Any] = await replica.actor.start.remote()
            return started
        try:
            address, port = await replica.actor.master.remote()
            count = len(replica.ranks) + 1
            ranks = await asyncio.gather(
                *(a.start.remote(VllmRank(i, count, address, port)) for i, a in enumerate(replica.ranks, 1))
            )
            head = await replica.actor.start.remote(VllmRank(0, count, address, port))
            return head | {"ranks": ranks}
        except BaseException:
            await asyncio.gather(*(a.stop.remote() for a in [replica.actor, *replica.ranks]), return_exceptions=True)
            raise

    async def start(self) -> None:
        """Every replica started at once, within the launch's deadline; those that fail are taken out, and with
        none started the ingress does not start (the first failure raised)."""
        timeout = self.launch.start_timeout_s + CALL_SLACK_S
        answers = await asyncio.gather(
            *(asyncio.wait_for(self._start(r), timeout) for r in self.replicas), return_exceptions=True
        )
        for replica, answer in zip(self.replicas, answers, strict=True):
            if isinstance(answer, BaseException):
                replica.failure = f"start: {answer!r}"
            else:
                replica.started = answer
        if not self.live():
            raise RuntimeError(f"no vLLM replica started: {self.replicas[0].failure}")

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.failure is None]

    def _choose(self) -> Replica:
        live = self.live()
        if not live:
            raise EngineDown("every vLLM replica failed: " + "; ".join(str(r.failure) for r in self.replicas))
        return min(live, key=lambda r: r.outstanding)

    async def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling,
        stop: list[str] | None = None,
        *,
        stream: bool,
        choice: int = 0,
    ) -> AsyncGenerator[Output, None]:
        """One generation on the least busy replica (see the module's docstring); ``choice`` changes nothing here."""
        body = completion_body(self.launch.served_model, prompt, max_tokens, sampling, stop)
        while True:
            replica = self._choose()
            replica.outstanding += 1
            replica.last_used = time.monotonic()
            sent = False
            try:
                pieces = self._stream(replica, body, len(prompt)) if stream else self._whole(replica, body, len(prompt))
                async for out in pieces:
                    sent = True
                    yield out
                self.served += 1
                return
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, VllmGone):  # its server died: the replica is out, as when the actor dies
                    replica.failure = f"{time.strftime('%H:%M:%S')} {exc.cause}"[:500]
                    if sent:
                        raise EngineDown(f"the vLLM replica failed mid-answer: {exc.cause}") from exc
                    continue
                if isinstance(exc.cause, VllmRefused):  # the server answered: the request's own failure
                    raise BadInput(str(exc.cause), "prompt") from exc
                raise RequestFailed(f"vLLM failed this request: {exc.cause}") from exc
            except ray.exceptions.RayError as exc:  # the actor (and its server) is gone: the replica is out
                replica.failure = f"{time.strftime('%H:%M:%S')} {exc!r}"[:500]
                if sent:
                    raise EngineDown(f"the vLLM replica failed mid-answer: {exc}") from exc
            except TimeoutError as exc:
                raise RequestFailed(f"vLLM did not answer within {self.launch.request_timeout_s:.0f} s") from exc
            finally:
                replica.outstanding -= 1

    async def _whole(self, replica: Replica, body: dict[str, Any], prompt_tokens: int) -> AsyncGenerator[Output, None]:
        answer = await asyncio.wait_for(
            replica.actor.complete.remote(body), self.launch.request_timeout_s + CALL_SLACK_S
        )
        first = answer["choices"][0]
        yield Output(first["text"], tuple(first.get("token_ids") or ()), first.get("finish_reason"), prompt_tokens)

    async def _stream(self, replica: Replica, body: dict[str, Any], prompt_tokens: int) -> AsyncGenerator[Output, None]:
        tokens: tuple[int, ...] = ()
        events = replica.actor.stream.options(num_returns="streaming").remote(body)
        deadline = time.monotonic() + self.launch.request_timeout_s + CALL_SLACK_S
        finished = False
        try:
            while True:
                try:
                    ref = await asyncio.wait_for(events.__anext__(), max(0.1, deadline - time.monotonic()))
                except StopAsyncIteration:
                    finished = True
                    return
                event = await ref
                for piece in event.get("choices", []):
                    tokens += tuple(piece.get("token_ids") or ())
                    if piece.get("text") or piece.get("finish_reason"):
                        yield Output(piece.get("text", ""), tokens, piece.get("finish_reason"), prompt_tokens)
        finally:
            if not finished:  # the client left or the deadline passed: vLLM stops generating for it
                with contextlib.suppress(Exception):
                    ray.cancel(events)

    def health(self) -> str | None:
        """Why the service cannot answer (None: it can)."""
        if self.live():
            return None
        return "no vLLM replica is up: " + "; ".join(str(r.failure) for r in self.replicas)

    async def probe(self, idle_s: float) -> None:
        """One real token from every live replica idle for ``idle_s``; a replica that does not generate is out."""
        now = time.monotonic()
        idle = [r for r in self.live() if r.outstanding == 0 and now - r.last_used > idle_s]
        answers = await asyncio.gather(
            *(asyncio.wait_for(r.actor.probe.remote(), 60.0) for r in idle), return_exceptions=True
        )
        for replica, answer in zip(idle, answers, strict=True):
            replica.last_used = time.monotonic()
            if isinstance(answer, BaseException):
                replica.failure = f"probe: {answer!r}"[:500]

    def status(self) -> dict[str, Any]:
        return {
            "engine": "vllm",
            "replicas": len(self.live()),
            "served": self.served,
            "vllm": [
                {"node_id": r.node_id, "outstanding": r.outstanding, "failure": r.failure, "started": r.started}
                for r in self.replicas
            ],
        }

    async def stop(self) -> None:
        actors = [a for r in self.replicas for a in (r.actor, *r.ranks)]
        await asyncio.gather(*(a.stop.remote() for a in actors), return_exceptions=True)
