"""`serve` on the real 3-host lab: a tiny random Llama with a real tokenizer, written by the test on this machine,
reaches every host (verified, once), is deployed from the head's container by Ray Serve, and the real `openai`
client (not our code) gets exactly what `transformers`' own `generate()` gives, with the service's own key.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
import uuid
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families

from raycluster_cli.config import inventory, state
from raycluster_cli.render.serve_bench import SVG_NS
from raycluster_cli.serve.metrics import METRICS

from ..serve_checkpoint import WORDS, write_chat_llama
from ..text_tokenizers import in_context
from .conftest import DOCKER, IP1, Lab

pytestmark = [pytest.mark.lab, pytest.mark.slow]

NEW_TOKENS = 10
METRIC_TAGS = {tag for metric in METRICS.values() for tag in metric.tags} | {"le"}
PROMPTS = [" ".join(WORDS[(5 * i + j) % len(WORDS)] for j in range(n)) for i, n in enumerate((1, 4, 9, 15, 22, 30))]


@dataclass
class Served:
    lab: Lab
    doc: dict[str, Any]
    token: str
    tokenizer: Any
    model: Any

    def client(self, key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.doc["url"], api_key=key or self.token, max_retries=0, timeout=300)

    def generate(self, ids: list[int]) -> str:
        out = self.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
        return in_context(self.tokenizer, ids, out[0, len(ids) :].tolist())  # as it reads after the prompt


@pytest.fixture(scope="module")
def served(lab_hosts: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    code, doc, err = lab_hosts.cli("up", timeout=1500)
    assert code == 0, err
    path = write_chat_llama(tmp_path_factory.mktemp("serve") / "tiny-chat")
    # a file of this run's own: a model no host holds yet (lab hosts keep their cluster folders across modules
    # and sessions, and other lab tests serve the same seeded checkpoint)
    (path / "NOTICE").write_text(f"raycluster serve lab test {uuid.uuid4()}\n")
    code, doc, err = lab_hosts.cli(
        "serve", f"--model-path={path}", "--max-seq=96", "--slots=8", "--rebalance-period=0", timeout=1200
    )
    assert code == 0, err[-4000:]
    token = Path(doc["api_key_file"]).read_text().strip()  # the service's own key, made by `serve` on this machine
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    try:
        yield Served(lab_hosts, doc | {"path": str(path)}, token, tokenizer, model)
    finally:
        lab_hosts.cli("serve", "--stop", timeout=300)


def test_the_model_reaches_every_host_once_and_the_service_answers_at_the_head(served: Served) -> None:
    doc = served.doc
    assert doc["url"] == f"http://{IP1}:8000/v1" and doc["model"] == "tiny-chat"
    assert sorted(c["action"] for c in doc["copies"]) == ["sent"] * 3
    assert doc["model_path"] == f"/run/raycluster/models/{doc['model_digest']}"
    # a second serve of the same files copies nothing and replaces the service with itself
    code, again, err = served.lab.cli(
        "serve", f"--model-path={doc['path']}", "--max-seq=96", "--rebalance-period=0", timeout=1200
    )
    assert code == 0, err[-3000:]
    assert [c["action"] for c in again["copies"]] == ["held"] * 3 and again["url"] == doc["url"]


def test_concurrent_greedy_requests_equal_transformers_generate(served: Served) -> None:
    async def one(prompt: str, stream: bool) -> str:
        client = served.client()
        args: dict[str, Any] = {"model": "tiny-chat", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        if not stream:
            return str((await client.completions.create(**args)).choices[0].text)
        pieces = [c.choices[0].text async for c in await client.completions.create(**args, stream=True) if c.choices]
        return "".join(pieces)

    async def every() -> list[str]:
        return await asyncio.gather(*(one(p, s) for p in PROMPTS for s in (False, True)))

    got = asyncio.run(every())
    want = [served.generate(served.tokenizer.encode(p)) for p in PROMPTS for _ in (False, True)]
    assert got == want


def test_chat_uses_the_checkpoints_template(served: Served) -> None:
    messages = [{"role": "user", "content": "hello cat"}]

    async def chat() -> Any:
        return await served.client().chat.completions.create(
            model="tiny-chat",
            messages=messages,
            max_tokens=NEW_TOKENS,
            temperature=0,  # type: ignore[arg-type]
        )

    answer = asyncio.run(chat())
    prompt = served.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = served.generate(served.tokenizer.encode(prompt, add_special_tokens=False))
    assert answer.choices[0].message.content == want


def test_a_prompt_is_scored_across_the_hosts_and_n_choices_come_back(served: Served) -> None:
    """Over the 3 hosts' direct links: an evaluation harness's loglikelihood request (token ids, ``echo``,
    ``logprobs: 1``, ``max_tokens: 1``) gets every prompt token's log-probability equal to transformers' own (the
    last stage sends every position's logits back for it), and a seeded request of n = 2 gets the two answers
    requests of n = 1 with seed and seed + 1 get."""
    ids = served.tokenizer.encode(PROMPTS[5])

    async def run() -> tuple[Any, Any, list[str]]:
        client = served.client()
        scored = await client.completions.create(
            model="tiny-chat", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0
        )
        args: dict[str, Any] = {"model": "tiny-chat", "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 1.2}
        two = await client.completions.create(**args, n=2, seed=5)
        singles = [(await client.completions.create(**args, seed=s)).choices[0].text for s in (5, 6)]
        return scored, two, singles

    scored, two, singles = asyncio.run(run())
    logprobs = scored.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == len(ids) + 1
    with torch.no_grad():
        expected = torch.log_softmax(served.model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for position in range(1, len(ids)):
        want = float(expected[position - 1, ids[position]])
        assert logprobs.token_logprobs[position] == pytest.approx(want, abs=1e-4)
    assert [c.text for c in two.choices] == singles


def _dashboard(path: str, key: str, body: dict[str, Any] | None = None) -> int:
    """The head's dashboard (Ray's REST API, the Jobs API among it) called with ``key``: the HTTP status."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://{IP1}:8265{path}",
        data=data,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_the_service_key_opens_the_service_only_and_the_cluster_token_opens_no_service_route(served: Served) -> None:
    """The service's key never opens the Jobs API (which runs code on every node), and the cluster's token (which
    does) is refused by the service; a key added with `serve --keys add` works at once and is refused at once once
    revoked, without a restart; none of the keys is ever printed."""
    cluster_token = state.token_file(inventory.load(served.lab.inventory).inventory).read_text().strip()
    assert _dashboard("/api/jobs/", cluster_token) == 200  # the token opens the Jobs API ...
    assert _dashboard("/api/jobs/", served.token) in (401, 403)  # ... the service's key does not
    assert _dashboard("/api/jobs/", served.token, {"entrypoint": "touch /tmp/pwned"}) in (401, 403)

    async def models(key: str) -> Any:
        return await served.client(key).models.list()

    for refused in ("not-the-key", cluster_token):
        with pytest.raises(openai.AuthenticationError):
            asyncio.run(models(refused))
    code, added, err = served.lab.cli("serve", "--keys", "add", "team-a", "--max-requests", "2")
    assert code == 0, err
    key = Path(added["key_file"]).read_text().strip()
    assert key not in json.dumps(added) + err and asyncio.run(models(key)).data[0].id == "tiny-chat"
    code, listed, err = served.lab.cli("serve", "--keys", "list")
    assert [(k["name"], k["max_requests"]) for k in listed["keys"]] == [("default", None), ("team-a", 2)], listed
    code, revoked, err = served.lab.cli("serve", "--keys", "revoke", "team-a")
    assert code == 0 and revoked["action"] == "revoked", err
    with pytest.raises(openai.AuthenticationError):
        asyncio.run(models(key))
    # the one route that asks no key: a load balancer's probe at the head's address, which says only this
    with urllib.request.urlopen(served.doc["url"].removesuffix("/v1") + "/health", timeout=30) as health:
        body = json.loads(health.read())
    assert health.status == 200 and body["status"] == "ok" and body["replicas"] >= 1, body


# A stranger's process on the cluster network: every listening TCP port of every lab host is tried as torch's
# rendezvous store (connect, write a forged rank-1 address record, list the keys), all at once, 3 s each.
_STRANGER = """
import json, os, sys, threading, time
from datetime import timedelta
import torch.distributed as dist
targets, answered = json.loads(sys.argv[1]), []
def one(ip, port):
    try:
        store = dist.TCPStore(ip, port, is_master=False, timeout=timedelta(seconds=3), wait_for_workers=False)
        store.set("0/1", b"forged")
        answered.append([ip, port, len(store.list_keys())])
    except Exception:
        pass
threads = [threading.Thread(target=one, args=(ip, port), daemon=True) for ip, port in targets]
[t.start() for t in threads]
end = time.monotonic() + 20  # one deadline for all: a port that never answers holds its thread, not the scan
[t.join(max(0.0, end - time.monotonic())) for t in threads]
print(json.dumps(answered), flush=True)
os._exit(0)  # the threads still connecting are abandoned, not waited for
"""


def _listening(served: Served, hostname: str) -> set[int]:
    """The TCP ports listening on a lab host (its network namespace, which its Ray container shares)."""
    table = served.lab.sh(hostname, "cat /proc/net/tcp /proc/net/tcp6")
    return {int(f[1].rsplit(":", 1)[1], 16) for f in (line.split() for line in table.splitlines()[1:]) if f[3] == "0A"}


def test_no_store_answers_a_stranger_on_the_cluster_network(served: Served) -> None:
    """While the 3 hosts' ring of direct links lives (the status says `direct`), a container of a stranger on the
    lab's network tries every port every host listens on as the links' rendezvous store: none answers (the ring
    formed over Ray's calls; before, a TCPStore on the head answered anyone for the ring's life), and the service
    answers exactly after his tries."""
    assert all(p["links"] == "direct" for p in _status(served)["pipelines"] if p["state"] == "live")
    targets = [[h.address, port] for h in served.lab.info.hosts for port in sorted(_listening(served, h.hostname))]
    assert len(targets) > 10, targets
    image = inventory.load(served.lab.inventory).inventory.image  # the node image: torch, as a stranger may have
    done = subprocess.run(
        [DOCKER, "run", "--rm", f"--network={served.lab.info.network}", image, "/opt/ray/bin/python", "-c",
         _STRANGER, json.dumps(targets)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [], "a rendezvous store answered a stranger"
    answer = asyncio.run(
        served.client().completions.create(model="tiny-chat", prompt=PROMPTS[1], max_tokens=NEW_TOKENS, temperature=0)
    )
    assert answer.choices[0].text == served.generate(served.tokenizer.encode(PROMPTS[1]))


def test_a_bad_prompt_fails_alone_and_takes_no_pipeline_down(served: Served) -> None:
    """Token ids outside the vocabulary beside a normal request on the 3 hosts' pipeline: 400 naming `prompt`, the
    normal request's exact greedy text, and no failover, no rebuild (before, the stage's embedding lookup failed the
    pipeline and the request was failed over to every pipeline in turn)."""
    before = _status(served)

    async def both() -> tuple[Any, BaseException]:
        client = served.client()
        good = client.completions.create(model="tiny-chat", prompt=PROMPTS[0], max_tokens=NEW_TOKENS, temperature=0)
        bad = client.completions.create(model="tiny-chat", prompt=[999999999], max_tokens=NEW_TOKENS, temperature=0)
        answer, error = await asyncio.gather(good, bad, return_exceptions=True)
        assert isinstance(error, BaseException), error
        return answer, error

    answer, error = asyncio.run(both())
    assert isinstance(error, openai.BadRequestError) and error.body["param"] == "prompt"
    assert answer.choices[0].text == served.generate(served.tokenizer.encode(PROMPTS[0]))
    after = _status(served)
    assert after["failovers"] == before["failovers"] and after["rebuilding"] == 0, after["events"]
    assert [p["index"] for p in after["pipelines"]] == [p["index"] for p in before["pipelines"]]


def test_bench_serve_measures_the_service_from_the_operator(served: Served, tmp_path: Path) -> None:
    """`bench --serve` against the 3-host service: every request answered with the asked length, each stage's
    T_i measured on its own host, and the SVG of latency against load."""
    svg = tmp_path / "latency.svg"
    args = ["--rates=1,4", "--requests=12", "--prompt-tokens=4:32", "--output-tokens=8:24", f"--save-svg={svg}"]
    code, doc, err = served.lab.cli("bench", "--serve", *args, timeout=900)
    assert code == 0, err[-3000:]
    assert doc["url"] == served.doc["url"] and doc["model"] == "tiny-chat" and doc["max_seq"] == 96
    assert [r["kind"] for r in doc["runs"]] == ["poisson", "poisson", "saturation"]
    hosts = {s["node_ip"] for p in served.doc["pipelines"] for s in p["stages"]}
    for run in doc["runs"]:
        assert (run["completed"], run["failed"]) == (12, 0), run["errors"]
        assert all(r["output_tokens"] == r["max_tokens"] and r["ttft_s"] <= r["e2e_s"] for r in run["per_request"])
        assert {s["node_ip"] for s in run["stages"]} == hosts and len(run["stages"]) == 3
        assert all(s["busy_s"] > 0 for s in run["stages"]) and len({s["steps"] for s in run["stages"]}) == 1
        assert run["t_max_minus_t_min_s"] >= 0 and 0 < run["of_ceiling"] <= 1
    assert len(ET.parse(svg).getroot().findall(f"{{{SVG_NS}}}circle")) == 4 * 2
    assert served.token not in json.dumps(doc) + err


def _scrape(ip: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The node's Prometheus endpoint (Ray's metrics agent, `ray.metrics_export_port`) read by the Prometheus
    project's own parser: this service's samples, by name and tags (Ray's per-process labels dropped, the
    processes' series summed)."""
    with urllib.request.urlopen(f"http://{ip}:8080/metrics", timeout=30) as response:
        text = response.read().decode()
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("ray_raycluster_serve_") and sample.labels.get("model") == "tiny-chat":
                tags = tuple(sorted((k, v) for k, v in sample.labels.items() if k in METRIC_TAGS))
                found[(sample.name, tags)] += sample.value
    return found


def _total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **tags: str) -> float:
    return sum(v for (n, t), v in samples.items() if n == name and set(tags.items()) <= set(t))


def test_the_service_exports_its_metrics_through_each_nodes_prometheus_endpoint(served: Served) -> None:
    """Requests, tokens, time to first token and each stage's steps and busy time reach Prometheus through every
    node's Ray metrics agent: the counts of six requests sent here equal what the `openai` client got (usage) and
    what the service's status says its stages ran."""
    live = [p for p in _status(served)["pipelines"] if p["state"] == "live"]
    (pipeline,) = live
    stages = [(str(i), s["node_ip"]) for i, s in enumerate(pipeline["stages"])]
    hosts = sorted({ip for _, ip in stages})

    def everything() -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
        return {ip: _scrape(ip) for ip in hosts}

    def settled() -> dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]:
        last = everything()
        for _ in range(8):  # Ray's agents export every 10 s: the same figures twice, 11 s apart, are all there is
            time.sleep(11)
            now = everything()
            if now == last:
                return now
            last = now
        raise AssertionError("the metrics did not settle within 90 s")

    def stage_steps() -> list[int]:
        (now,) = [p for p in _status(served)["pipelines"] if p["index"] == pipeline["index"]]
        return [int(s["steps"]) for s in now["stages"]]

    before, steps_before = settled(), stage_steps()

    async def six() -> list[Any]:
        client = served.client()
        asks = [
            client.completions.create(model="tiny-chat", prompt=p, max_tokens=NEW_TOKENS, temperature=0)
            for p in PROMPTS
        ]
        return list(await asyncio.gather(*asks))

    answers = asyncio.run(six())
    after = settled()
    steps = [a - b for a, b in zip(stage_steps(), steps_before, strict=True)]
    head = IP1

    def grew(name: str, ip: str = head, **tags: str) -> float:
        return _total(after[ip], name, **tags) - _total(before[ip], name, **tags)

    assert grew("ray_raycluster_serve_requests_total") == len(PROMPTS)
    assert grew("ray_raycluster_serve_prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    assert grew("ray_raycluster_serve_generation_tokens_total") == sum(a.usage.completion_tokens for a in answers)
    assert grew("ray_raycluster_serve_time_to_first_token_seconds_count") == len(PROMPTS)
    assert grew("ray_raycluster_serve_e2e_request_latency_seconds_count") == len(PROMPTS)
    assert _total(after[head], "ray_raycluster_serve_replicas_live") >= 1
    for (stage, ip), ran in zip(stages, steps, strict=True):
        tags = {"stage": stage, "node_ip": ip, "pipeline": str(pipeline["index"])}
        assert grew("ray_raycluster_serve_stage_steps_total", ip, **tags) == ran > 0, (stage, ip)
        assert grew("ray_raycluster_serve_stage_busy_seconds_total", ip, **tags) > 0, (stage, ip)


def _status(served: Served) -> dict[str, Any]:
    request = urllib.request.Request(
        served.doc["url"].removesuffix("/v1") + "/raycluster/status",
        headers={"Authorization": f"Bearer {served.token}"},
    )
    with urllib.request.urlopen(request, timeout=30) as answer:
        data: dict[str, Any] = json.loads(answer.read())
    return data


def test_status_shows_the_service_and_serve_stop_removes_it(served: Served) -> None:
    code, doc, err = served.lab.cli("status")
    assert doc["service"]["serve"]["status"] == "RUNNING", (doc.get("service"), err[-2000:])
    assert doc["service"]["record"]["model"] == "tiny-chat" and doc["service"]["record"]["url"] == served.doc["url"]
    live = doc["service"]["live"]  # the service's own view: its pipeline now and what it served (the tests above)
    (pipeline,) = [p for p in live["pipelines"] if p["state"] == "live"]
    assert len(pipeline["stages"]) == 3 and pipeline["served"] > 0, live
    # the steps went over direct links between the three hosts (not Ray's calls): the ring formed across hosts
    assert pipeline["links"] == "direct" and "links_note" not in pipeline, pipeline
    code, stopped, err = served.lab.cli("serve", "--stop", timeout=300)
    assert code == 0 and stopped["removed"] is True, err
    code, doc, err = served.lab.cli("status")
    assert doc["service"] is None, doc["service"]
    code, again, err = served.lab.cli("serve", "--stop", timeout=300)
    assert code == 0 and again["removed"] is False
