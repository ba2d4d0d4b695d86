"""`raycluster drain` on a real local service: a two-node Ray (two raylets on this machine, as the live re-split's
test), one two-stage pipeline pinned one stage per node, 12 streams of the real ``openai`` client running.

The worker node is drained through the very script `raycluster drain` runs in the head's container
(``verbs.drain._CALL``: it joins the cluster and calls the ingress's ``drain`` through Ray Serve's handle): the
replacement over the head alone is built first, then the old pipeline drains.  No request fails, every answer is
``transformers``' greedy one, the service lists the node as drained and no pipeline uses it; let back
(``take_in``), the node is in a pipeline again at once (the periodic look is an hour away).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.extended]

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

from raycluster_cli.models.decoder import config_from_checkpoint  # noqa: E402
from raycluster_cli.placement.pipelines import NodeSpeed, split_over  # noqa: E402
from raycluster_cli.serve.app import build_app  # noqa: E402
from raycluster_cli.serve.scheduler import Limits  # noqa: E402
from raycluster_cli.serve.settings import ServeSettings  # noqa: E402
from raycluster_cli.verbs.drain import _CALL  # noqa: E402
from raycluster_cli.verbs.serve import APP  # noqa: E402

from ..local_ray import write_keys  # noqa: E402
from ..serve_checkpoint import WORDS, write_chat_llama  # noqa: E402
from ..text_tokenizers import in_context  # noqa: E402

TOKEN = "drain-token"
MODEL = "tiny-chat-llama"
NEW_TOKENS = 24
PROMPTS = [" ".join(WORDS[(7 * i + j * 3) % len(WORDS)] for j in range(n)) for i, n in enumerate(range(2, 14))]


@dataclass
class Service:
    base_url: str
    address: str  # the Ray cluster's, for the operator's script
    head: str
    worker: str
    tokenizer: Any
    model: Any

    def generate(self, prompt: str) -> str:
        ids = self.tokenizer.encode(prompt)
        out = self.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
        return in_context(self.tokenizer, ids, out[0, len(ids) :].tolist())

    def status(self) -> dict[str, Any]:
        url = self.base_url.removesuffix("/v1") + "/raycluster/status"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            data: dict[str, Any] = json.loads(response.read())
        return data

    def call(self, method: str, args: list[Any]) -> dict[str, Any]:
        """The ingress's ``method`` through the script `raycluster drain` runs on the head (its own process)."""
        asked = json.dumps({"method": method, "args": args, "timeout_s": 240})
        env = os.environ | {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "disabled"}
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # loopback only, as this process's Ray
        done = subprocess.run(
            [sys.executable, "-c", _CALL % {"app": APP}],
            input=asked,
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        assert done.returncode == 0 and lines, done.stderr[-2000:]
        answer: dict[str, Any] = json.loads(lines[-1])
        return answer


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    path = write_chat_llama(tmp_path_factory.mktemp("drain") / MODEL)
    layers = config_from_checkpoint(path, max_seq=128).layers
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # loopback only
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 2, "include_dashboard": False, "node_ip_address": "127.0.0.1"},
        )
        cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1")
        try:
            ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
            cluster.wait_for_nodes()
            head = ray.get_runtime_context().get_node_id()
            worker = next(str(n["NodeID"]) for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
            units = layers + 2
            speeds = (NodeSpeed(head, "127.0.0.1", (1e-3,) * units), NodeSpeed(worker, "127.0.0.1", (1e-3,) * units))
            settings = ServeSettings(
                model_path=str(path),
                keys_file=write_keys(tmp_path_factory.mktemp("keys") / "keys.json", {"default": TOKEN}),
                stages=2,
                plans=(split_over(list(speeds)),),
                speeds=speeds,
                num_threads=1,
                replace_period_s=3600,
                rebalance_period_s=0,
                limits=Limits(slots=8, step_tokens=48, prefill_chunk=8, max_seq=128, max_waiting=16),
            )
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(settings, health_check_period_s=2), name=APP, route_prefix="/")
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
            yield Service(f"http://127.0.0.1:{port}/v1", cluster.address, head, worker, tokenizer, model)
        finally:
            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()


async def _load_while(service: Service, method: str, args: list[Any]) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """12 clients streaming greedy completions one after another until ``method`` (called as the CLI calls it, once
    every client has a piece) has returned and each has run one more; every (prompt, text) they got."""
    client = openai.AsyncOpenAI(base_url=service.base_url, api_key=TOKEN, max_retries=0, timeout=300)
    started: set[int] = set()
    all_started, done = asyncio.Event(), asyncio.Event()
    got: list[tuple[str, str]] = []

    async def one(index: int, prompt: str) -> None:
        pieces = []
        args = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True}
        async for chunk in await client.completions.create(**args):
            pieces += [c.text for c in chunk.choices]
            started.add(index)
            if len(started) == len(PROMPTS):
                all_started.set()
        got.append((prompt, "".join(pieces)))

    async def client_loop(index: int) -> None:
        turn = 0
        while not done.is_set():
            await one(index, PROMPTS[(index + turn) % len(PROMPTS)])
            turn += 1
        await one(index, PROMPTS[index])  # one more after the call: served without the node

    async def operator() -> dict[str, Any]:
        await all_started.wait()
        try:
            return await asyncio.to_thread(service.call, method, args)
        finally:
            done.set()

    _, answer = await asyncio.gather(asyncio.gather(*(client_loop(i) for i in range(len(PROMPTS)))), operator())
    return got, answer


def _nodes(status: dict[str, Any]) -> list[list[str]]:
    return [[st["node_id"] for st in p["stages"]] for p in status["pipelines"] if p["state"] == "live"]


def _settled(service: Service) -> dict[str, Any]:
    """The service's status once no pipeline is draining any more (the drained ones retired)."""
    began = time.monotonic()
    status = service.status()
    while any(p["state"] != "live" for p in status["pipelines"]) and time.monotonic() - began < 30:
        time.sleep(0.5)
        status = service.status()
    return status


def _check(service: Service, got: list[tuple[str, str]]) -> None:
    greedy = {prompt: service.generate(prompt) for prompt in {p for p, _ in got}}
    for prompt, text in got:
        assert text == greedy[prompt], prompt


def test_a_node_drained_under_load_fails_no_request_and_comes_back_at_once(service: Service) -> None:
    """Drained with a deadline the streams meet: the replacement is built while the clients go on, the drained
    pipeline's streams finish where they are, none fails or moves; let back, the node serves again at once."""
    assert _nodes(service.status()) == [[service.head, service.worker]]
    got, answer = asyncio.run(_load_while(service, "drain", [service.worker, 120]))
    _check(service, got)
    drained = answer["answer"]
    print(f"drain: {drained}; {len(got)} requests answered")
    assert drained["drained"] == [0] and len(drained["replaced_by"]) == 1
    assert drained["moved"] == 0 and drained["finished"] > 0  # it drained under load
    status = _settled(service)
    assert status["failovers"] == 0  # nothing had to move: the streams finished where they were
    assert [d["node"] for d in status["drained"]] == [service.worker]
    assert _nodes(status) == [[service.head]]  # re-split without the node

    back = service.call("take_in", [[service.worker]])["answer"]
    assert back["undrained"] == [service.worker] and len(back["grown"]) == 1
    status = _settled(service)
    assert status["drained"] == [] and _nodes(status) == [[service.head, service.worker]]


def test_streams_left_at_the_deadline_move_on_and_no_request_fails(service: Service) -> None:
    """Drained with no time to finish: the streams still on the node's pipeline at the deadline continue on its
    replacement from the tokens they sent (failover's way), and every answer is still the greedy one."""
    status = _settled(service)
    before = status["failovers"]
    got, answer = asyncio.run(_load_while(service, "drain", [service.worker, 0]))
    _check(service, got)
    drained = answer["answer"]
    print(f"drain at once: {drained}; {len(got)} requests answered")
    assert drained["moved"] > 0 and _settled(service)["failovers"] > before
    assert _nodes(_settled(service)) == [[service.head]]
