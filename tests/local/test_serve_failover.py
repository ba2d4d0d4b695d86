"""Two pipelines on a throwaway local Ray: a stage killed under 12 streamed requests, none fails.

One Ray node (``ray.init(num_cpus=4)``) holds both pipelines' stage actors: the pipelines are
unpinned, so what is simulated is a stage actor's death (``ray.kill``), not a node's; the re-split
of a dead node's survivors is tested on placements in tests/unit/test_serve_placement.py and
test_serve_pool.py.  Every answer is checked against ``transformers``' ``generate(do_sample=False)``,
through the real ``openai`` client.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from raycluster_cli.models.decoder import config_from_checkpoint  # noqa: E402
from raycluster_cli.placement.pipelines import plan_replicas  # noqa: E402
from raycluster_cli.serve.app import build_app  # noqa: E402
from raycluster_cli.serve.fleet import Calibration, alive_nodes, measure  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.settings import ServeSettings  # noqa: E402
from raycluster_cli.serve.stages import STAGE_NAMESPACE  # noqa: E402

from ..local_ray import local_serve, write_keys  # noqa: E402
from ..openai_penalties import OpenAIPenalties  # noqa: E402
from ..serve_checkpoint import WORDS, write_chat_llama  # noqa: E402
from ..serve_service import wait_until  # noqa: E402
from ..text_tokenizers import in_context  # noqa: E402

TOKEN = "failover-token"
MODEL = "tiny-chat-llama"
NEW_TOKENS = 24
PROMPTS = [" ".join(WORDS[(11 * i + j * 5) % len(WORDS)] for j in range(n)) for i, n in enumerate(range(2, 14))]


@dataclass
class Service:
    base_url: str
    path: Path
    tokenizer: Any
    model: Any

    def generate(self, prompt: str, frequency_penalty: float = 0.0) -> str:
        """transformers' greedy answer; with a frequency penalty, OpenAI's formula as its logits processor."""
        ids = self.tokenizer.encode(prompt)
        penalties = transformers.LogitsProcessorList([OpenAIPenalties(len(ids), frequency_penalty, 0.0)])
        out = self.model.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, logits_processor=penalties
        )
        return in_context(self.tokenizer, ids, out[0, len(ids) :].tolist())

    def status(self) -> dict[str, Any]:
        url = self.base_url.removesuffix("/v1") + "/raycluster/status"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            data: dict[str, Any] = json.loads(response.read())
        return data


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    path = write_chat_llama(tmp_path_factory.mktemp("failover") / MODEL)
    settings = ServeSettings(
        model_path=str(path),
        keys_file=write_keys(tmp_path_factory.mktemp("keys") / "keys.json", {"default": TOKEN}),
        stages=2,
        split=(2, 1),
        replicas=2,
        num_threads=1,
        limits=Limits(slots=8, step_tokens=48, prefill_chunk=8, max_seq=128, max_waiting=16),
    )
    with local_serve(build_app(settings, health_check_period_s=2), num_cpus=4) as root:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
        found = Service(f"{root}/v1", path, tokenizer, model)
        wait_until(lambda: found.status()["replicas"] == 2, 60, "two pipelines")
        yield found


async def _streams(service: Service, killed: list[float]) -> list[str]:
    """12 streamed greedy completions at once; once every stream has a piece, pipeline 0's last stage
    is killed."""
    client = openai.AsyncOpenAI(base_url=service.base_url, api_key=TOKEN, max_retries=0, timeout=180)
    started: set[int] = set()
    all_started = asyncio.Event()

    async def one(index: int, prompt: str) -> str:
        pieces = []
        args = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True}
        async for chunk in await client.completions.create(**args):
            pieces += [c.text for c in chunk.choices]
            started.add(index)
            if len(started) == len(PROMPTS):
                all_started.set()
        return "".join(pieces)

    async def kill() -> None:
        await all_started.wait()
        stage = ray.get_actor("raycluster-stage-0-1", namespace=STAGE_NAMESPACE)
        ray.kill(stage, no_restart=True)
        killed.append(time.monotonic())

    texts, _ = await asyncio.gather(asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))), kill())
    return list(texts)


def test_a_stage_killed_under_load_fails_no_request_and_capacity_returns(service: Service) -> None:
    killed: list[float] = []
    texts = asyncio.run(_streams(service, killed))
    for prompt, text in zip(PROMPTS, texts, strict=True):
        assert text == service.generate(prompt), prompt
    status = service.status()
    assert status["failovers"] >= 1  # some streams really moved
    wait_until(lambda: service.status()["replicas"] == 2, 60, "capacity back")
    back_s = time.monotonic() - killed[0]
    print(f"failovers {status['failovers']}; two pipelines again {back_s:.1f} s after the kill")
    assert back_s < 60
    events = [e["event"] for e in service.status()["events"]]
    assert "failed" in events and "replaced" in events


def _penalty(index: int) -> float:
    """Every other request of several choices is also penalized for the tokens it repeats."""
    return 0.8 if index % 2 else 0.0


async def _choice_streams(service: Service, prompts: list[str]) -> list[list[str]]:
    """Streamed greedy completions of n = 2 at once; once every request has a piece of both its choices, the
    last stage of the live pipeline holding the most of them is killed."""
    client = openai.AsyncOpenAI(base_url=service.base_url, api_key=TOKEN, max_retries=0, timeout=180)
    started: set[int] = set()
    all_started = asyncio.Event()

    async def one(index: int, prompt: str) -> list[str]:
        pieces: list[list[str]] = [[], []]
        args = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True, "n": 2}
        args["frequency_penalty"] = _penalty(index)
        async for chunk in await client.completions.create(**args):
            for choice in chunk.choices:
                pieces[choice.index].append(choice.text)
            if all(pieces):
                started.add(index)
                if len(started) == len(prompts):
                    all_started.set()
        return ["".join(p) for p in pieces]

    async def kill() -> None:
        await all_started.wait()
        pipelines = (await asyncio.to_thread(service.status))["pipelines"]
        busiest = max((p for p in pipelines if p["state"] == "live"), key=lambda p: p["requests"])
        assert busiest["requests"] > 0  # the kill lands mid-answer
        stage = ray.get_actor(f"raycluster-stage-{busiest['index']}-1", namespace=STAGE_NAMESPACE)
        ray.kill(stage, no_restart=True)

    texts, _ = await asyncio.gather(asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))), kill())
    return list(texts)


def test_a_stage_killed_mid_answer_of_several_choices_fails_no_choice(service: Service) -> None:
    """Requests of n = 2 streamed when a stage dies: every choice of every request is moved, none fails, and
    each choice's text, put back together from the stream's pieces by their index, is the greedy answer — with a
    frequency penalty, the answer penalized for every token it generated, those sent before the move included."""
    wait_until(lambda: service.status()["replicas"] == 2, 60, "two pipelines")
    before = service.status()["failovers"]
    prompts = PROMPTS[:6]
    answers = asyncio.run(_choice_streams(service, prompts))
    for index, (prompt, choices) in enumerate(zip(prompts, answers, strict=True)):
        want = service.generate(prompt, _penalty(index))
        assert choices == [want, want], prompt
        if _penalty(index):
            assert want != service.generate(prompt), prompt  # the penalty changes the answer
    assert service.status()["failovers"] > before  # some choices really moved


def test_a_node_is_measured_and_placed_by_the_bench_calibration(service: Service) -> None:
    """The launcher's placement path on the one real node: a cost per unit, one whole-model replica."""
    cfg = config_from_checkpoint(service.path, max_seq=64)
    nodes = alive_nodes()
    (speed,) = measure(cfg, nodes, Calibration(batch=2, prompt_len=8, decode_steps=2, repeats=1, min_sample_s=0.01))
    assert len(speed.unit_costs) == cfg.num_units and min(speed.unit_costs) > 0
    (plan,) = plan_replicas([speed], stages=1)
    assert plan.ranges == ((0, cfg.num_units),) and plan.node_ids == (next(iter(nodes)),)
