"""A vLLM pipeline of two ranks behind our ingress, its uneven split from ``placement.vllm_split``: vLLM's own
multi-node mode (``--nnodes``, each rank started by our actor; vLLM's Ray backend refuses CPUs), greedy text equal
to ``transformers``' through our routes and keys, streamed and not.

Both ranks run on this machine's one Ray node (a lab runs them on two).  Without ``--enforce-eager``: on CPU a
later stage's first step fails with it (its buffer for the hidden states comes from the compile's warm-up), so
each rank compiles (~1-2 min).  Skipped without a vLLM Python, as tests/local/test_serve_vllm.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from raycluster_cli.host.containers import SERVE_ENV  # noqa: E402
from raycluster_cli.models.decoder import config_from_checkpoint  # noqa: E402
from raycluster_cli.node.vllm_server import VllmLaunch  # noqa: E402
from raycluster_cli.placement.pipelines import NodeSpeed  # noqa: E402
from raycluster_cli.placement.vllm_split import VllmNode, vllm_split  # noqa: E402
from raycluster_cli.serve.app import build_app  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.settings import ServeSettings  # noqa: E402

from ..local_ray import local_serve, write_keys  # noqa: E402
from ..serve_checkpoint import write_chat_llama  # noqa: E402
from .test_serve_vllm import MODEL, PROMPTS, SIZES, TOKEN, VLLM_PYTHON, Service, _complete  # noqa: E402

GB = 10**9


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Service, Any]]:
    path = write_chat_llama(tmp_path_factory.mktemp("vllm-pp") / MODEL, **SIZES)
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    write_keys(keys, {"default": TOKEN})
    cfg = config_from_checkpoint(path, max_seq=128)
    layers = cfg.layers
    fast = VllmNode(NodeSpeed("", "fast", (0.1, *([1.0] * layers), 0.1)), 16 * GB, 12 * GB)
    slow = VllmNode(NodeSpeed("", "slow", (0.3, *([3.0] * layers), 0.3)), 16 * GB, 12 * GB)
    split = vllm_split(cfg, [fast, slow], kv_tokens=1024)
    launch = VllmLaunch(
        python=VLLM_PYTHON,
        model_path=str(path),
        served_model=MODEL,
        max_model_len=128,
        env=(*split.env().items(), ("VLLM_CPU_KVCACHE_SPACE", "1")),
        start_timeout_s=900,
        request_timeout_s=120,
        log_dir=str(tmp_path_factory.mktemp("vllm-log")),
    )
    settings = ServeSettings(
        model_path=str(path), keys_file=str(keys), limits=Limits(max_seq=128), vllm=launch, vllm_pipelines=(("", ""),)
    )
    with local_serve(build_app(settings, health_check_period_s=2), SERVE_ENV) as root:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
        yield Service(root, tokenizer, model), split


def test_the_split_is_uneven_and_the_pipeline_generates_transformers_greedy(pipeline: tuple[Service, Any]) -> None:
    service, split = pipeline
    assert split.layers == (3, 1), split.why  # the fast node first, three times the speed

    async def run() -> list[str]:
        client = service.client()
        return list(await asyncio.gather(*(_complete(client, p, s) for p in PROMPTS for s in (False, True))))

    answers = asyncio.run(run())
    for index, prompt in enumerate(PROMPTS):
        want = service.generate(service.tokenizer.encode(prompt))
        assert answers[2 * index : 2 * index + 2] == [want, want], prompt
    import httpx2

    status = httpx2.get(f"{service.root}/raycluster/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    started = status.json()["vllm"][0]["started"]
    assert [r["node_rank"] for r in started["ranks"]] == [1]  # stage 1 ran as its own vLLM process, headless
