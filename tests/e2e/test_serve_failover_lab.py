"""`serve` on the real 3-host lab loses a machine under steady load, then gets it back (issue 31, item 4).

Three one-stage replicas (one per host).  A worker's lab host is killed (`docker kill` of the host container: its
Ray processes, its network namespace and its address vanish at once, with no FIN or RST, as when a machine loses
power) while streamed greedy completions run through the real `openai` client.  Every answer must equal
`transformers`' own `generate()` (a stream that moved continues where it was: no token lost or repeated), no request
fails, and within 20 s of the kill `/raycluster/status` shows the service at full capacity without the dead node
(its pipeline gone, the two others live; the issue's 60 s would pass a service that waited for the 30 s stall
deadline) and a fresh request is answered.  Then the host boots again, its engine
restarts its Ray container (its restart policy; `raycluster up` finds it running, or starts it), and the service
takes the returned node in as a new replica by itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import transformers

from ..serve_checkpoint import WORDS, write_chat_llama
from ..text_tokenizers import in_context
from .conftest import IP1, IP3, Lab
from .faults import freeze, power_off, power_on, thaw, wait_until

pytestmark = [pytest.mark.lab, pytest.mark.slow]

MODEL = "tiny-chat"
NEW_TOKENS = 24
CLIENTS = 6  # streams at once, over and over: about two on each replica
PROMPTS = [" ".join(WORDS[(7 * i + 3 * j) % len(WORDS)] for j in range(2 + i % 9)) for i in range(18)]
DEAD = "lab-h3"  # a worker: the head (lab-h1) holds the GCS, the Serve controller, the proxy and the ingress
RECOVERY_LIMIT_S = 60.0  # the target: capacity without the dead node back within this
# A frozen machine's pipeline is failed once its stages do not answer a ping (serve.pool's liveness look: steps
# overdue 2 s, a ping unanswered 5 s), well before the 30 s stall deadline that alone caught it before
FROZEN_LIMIT_S = 20.0
# A machine switched off is found the same way (its replica's steps overdue, its stage's ping unanswered): the other
# replicas serve alone well within this (8.3 s on the lab), where 60 s would pass a service that waited for the
# 30 s stall deadline
SWITCHED_OFF_LIMIT_S = 20.0
RAY_CONTAINER = "$(docker ps -q --filter label=io.raycluster.cluster=lab)"  # on a lab host, its Ray node
RETURN_LIMIT_S = 150.0  # the pool looks for free nodes every 30 s, then measures the node and builds on it
ROUNDS = int(os.environ.get("RAYCLUSTER_FAILOVER_ROUNDS", "1"))  # machine lost and back, again and again
FIGURES: list[dict[str, float]] = []


@dataclass
class Served:
    lab: Lab
    token: str
    url: str
    tokenizer: Any
    model: Any
    wanted: dict[str, str] = field(default_factory=dict)

    def want(self, prompt: str) -> str:
        if prompt not in self.wanted:
            ids = self.tokenizer.encode(prompt)
            out = self.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS)
            self.wanted[prompt] = in_context(self.tokenizer, ids, out[0, len(ids) :].tolist())
        return self.wanted[prompt]

    def status(self) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url.removesuffix("/v1") + "/raycluster/status", headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=20) as answer:
            data: dict[str, Any] = json.loads(answer.read())
        return data

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url, api_key=self.token, max_retries=0, timeout=300)

    async def complete(self, prompt: str, *, stream: bool) -> str:
        args: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
        client = self.client()
        if not stream:
            return str((await client.completions.create(**args)).choices[0].text)
        chunks = await client.completions.create(**args, stream=True)
        return "".join([c.text async for chunk in chunks for c in chunk.choices])


def pipeline_ips(status: dict[str, Any], state_: str = "live") -> list[list[str]]:
    return [[s["node_ip"] for s in p["stages"]] for p in status["pipelines"] if p["state"] == state_]


class Load:
    """CLIENTS greedy completions at once, each client starting its next as its last ends, in a thread of its
    own until ``stop``; every answer is kept with its prompt (or the error that ended it)."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self.answers: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=400)

    async def _run(self) -> None:
        async def client(index: int) -> None:
            turn = index
            while not self._stop.is_set():
                prompt = PROMPTS[turn % len(PROMPTS)]
                turn += CLIENTS
                try:  # one client in three asks for whole answers (run again elsewhere when moved)
                    answer = await self.served.complete(prompt, stream=index % 3 != 2)
                    self.answers.append((prompt, answer))
                except Exception as exc:  # a failed request: what the test counts
                    self.errors.append(f"{prompt!r}: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(client(i) for i in range(CLIENTS)))

    def wrong(self) -> list[tuple[str, str, str]]:
        return [(p, got, self.served.want(p)) for p, got in self.answers if got != self.served.want(p)]


def serve_tiny(lab: Lab, folder: Path, stages: int, replicas: int, inventory: str | None = None) -> Served:
    """`serve` of the tiny chat checkpoint (written to ``folder``) with ``--stages``, checked to give ``replicas``:
    the service as the lab tests' clients use it, each prompt's greedy answer worked out beforehand."""
    path = write_chat_llama(folder / MODEL)
    args = ("serve", f"--model-path={path}", f"--stages={stages}", "--max-seq=96", "--slots=8")
    code, doc, err = lab.cli(*args, inventory=inventory, timeout=1200)
    assert code == 0, err[-4000:]
    assert doc["replicas"] == replicas, doc
    token = Path(doc["api_key_file"]).read_text().strip()  # the service's own key (never the cluster's token)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    found = Served(lab, token, doc["url"], tokenizer, model)
    for prompt in PROMPTS:
        found.want(prompt)
    return found


@pytest.fixture(scope="module")
def served(lab_hosts: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    code, _, err = lab_hosts.cli("up", timeout=1500)
    assert code == 0, err
    try:
        yield serve_tiny(lab_hosts, tmp_path_factory.mktemp("failover"), stages=1, replicas=3)
    finally:
        lab_hosts.cli("serve", "--stop", timeout=300)


def _seconds_until(condition: Callable[[], bool], limit_s: float, what: str, began: float) -> float:
    def check() -> bool:
        try:
            return condition()
        except OSError:
            return False

    assert wait_until(check, limit_s, step=0.5), f"{what}: not within {limit_s} s"
    return time.monotonic() - began


def _lose(served: Served) -> dict[str, float]:
    """Kill the machine under load; every answer right, none failed, the two survivors serving within 60 s."""
    with Load(served) as load:
        assert wait_until(lambda: len(load.answers) >= 2 * CLIENTS, 300), load.errors
        before = len(load.answers)
        killed, killed_wall = time.monotonic(), time.time()  # from the moment its network goes silent
        power_off(served.lab, DEAD)

        def without_the_dead_node() -> bool:
            status = served.status()
            ips = [s["node_ip"] for p in status["pipelines"] for s in p["stages"]]
            return status["replicas"] == 2 and IP3 not in ips

        out_s = _seconds_until(without_the_dead_node, SWITCHED_OFF_LIMIT_S, "the dead pipeline out", killed)
        fresh = PROMPTS[5]
        assert asyncio.run(served.complete(fresh, stream=False)) == served.want(fresh)
        recovered_s = time.monotonic() - killed
        # the steady load goes on over the two survivors a while
        assert wait_until(lambda: len(load.answers) >= before + 3 * CLIENTS, 300), load.errors

    def new_events() -> list[dict[str, Any]]:  # the service's clock is this machine's (the lab shares its kernel)
        return [e for e in served.status()["events"] if e["at"] >= killed_wall]

    # the dead pipeline's replacement decides (the dead node no longer answers) after the service is back
    assert wait_until(lambda: any("replace" in e["event"] for e in new_events()), 90), new_events()
    status = served.status()
    events = new_events()
    failed = [e for e in events if e["event"] == "failed"]
    print(
        f"\n[failover] kill -> pipeline out {out_s:.1f} s, -> fresh answer {recovered_s:.1f} s;"
        f" failovers {status['failovers']}; {len(load.answers)} answers, {len(load.errors)} errors; events {events}"
    )
    assert load.errors == []
    assert load.wrong() == []
    assert any(e["event"] == "failover" for e in events)  # requests really were on the lost node and moved
    assert failed and recovered_s < SWITCHED_OFF_LIMIT_S + 5  # and a fresh request answered by the others
    # nothing is rebuilt on the dead node (the GCS lists it for a while yet): it has no survivor to re-split
    assert [e["event"] for e in events if "replace" in e["event"]] == ["not replaced"], events
    assert sorted(pipeline_ips(status)) == sorted([[IP1], [served.lab.host("lab-h2").address]])
    return {"failed_s": failed[0]["at"] - killed_wall, "out_s": out_s, "recovered_s": recovered_s}


def _return(served: Served) -> dict[str, float]:
    """Boot the machine, `up`: the service takes the returned node in as a replica of its own, under load."""
    lab = served.lab
    power_on(lab, DEAD)
    with Load(served) as load:
        code, doc, err = lab.cli("up", timeout=900)
        assert code == 0, err[-3000:]
        # its engine restarted the Ray container by its restart policy, and `up` keeps it ("running"), unless `up`
        # looked before the engine had started it again
        assert {n["host"]: n["action"] for n in doc["nodes"]}[IP3] in ("running", "restarted"), doc["nodes"]
        up_done = time.monotonic()

        def taken_in() -> bool:
            status = served.status()
            return status["replicas"] == 3 and [IP3] in pipeline_ips(status)

        back_s = _seconds_until(taken_in, RETURN_LIMIT_S, "the returned node serving", up_done)
        fresh = PROMPTS[7]
        assert asyncio.run(served.complete(fresh, stream=False)) == served.want(fresh)
        before = len(load.answers)
        assert wait_until(lambda: len(load.answers) >= before + 3 * CLIENTS, 300), load.errors
    status = served.status()
    on_returned = [p for p in status["pipelines"] if [s["node_ip"] for s in p["stages"]] == [IP3]]
    print(f"\n[return] `up` done -> the returned node serving {back_s:.1f} s; events {status['events'][-2:]}")
    assert load.errors == [] and load.wrong() == []
    assert on_returned and on_returned[0]["served"] >= 1
    assert status["events"][-1]["event"] == "grown"
    return {"back_s": back_s}


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_machine_lost_under_load_fails_no_request_and_the_machine_back_is_taken_in(
    served: Served, round_: int
) -> None:
    assert sorted(ip for ips in pipeline_ips(served.status()) for ip in ips) == sorted(
        h.address for h in served.lab.info.hosts
    )
    figures = _lose(served) | _return(served)
    FIGURES.append(figures)
    print(f"\n[round {round_}] " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()))
    if len(FIGURES) == ROUNDS:
        for key in figures:
            values = sorted(f[key] for f in FIGURES)
            print(f"[all rounds] {key}: median {statistics.median(values):.1f} s, {values[0]:.1f}-{values[-1]:.1f} s")


def test_a_frozen_machine_is_taken_out_within_seconds_and_back_in_when_it_thaws(served: Served) -> None:
    """A worker's lab host frozen under load (`docker pause` of its Ray container and of the host: every process
    stops, no connection closes, the GCS still lists the node): its pipeline is failed once its stage does not answer a ping, well before the 30 s
    stall deadline; its requests finish on the others, right and none failed.  Thawed seconds later (before Ray's
    own health checks give the node up), the node is serving again by itself, no `up` needed."""
    lab = served.lab
    assert sorted(pipeline_ips(served.status())) == sorted([[h.address] for h in lab.info.hosts])
    with Load(served) as load:
        assert wait_until(lambda: len(load.answers) >= 2 * CLIENTS, 300), load.errors
        frozen_at, frozen_wall = time.monotonic(), time.time()
        lab.sh(DEAD, f"docker pause {RAY_CONTAINER}")  # its Ray node (a cgroup of its own, not under the host's)
        freeze(lab, DEAD)  # and the host itself: sshd, its engine
        try:

            def failed() -> list[dict[str, Any]]:
                return [e for e in served.status()["events"] if e["event"] == "failed" and e["at"] >= frozen_wall]

            _seconds_until(lambda: bool(failed()), RECOVERY_LIMIT_S, "the frozen pipeline failed", frozen_at)
            fresh = PROMPTS[5]
            assert asyncio.run(served.complete(fresh, stream=False)) == served.want(fresh)
            recovered_s = time.monotonic() - frozen_at
        finally:
            thaw(lab, DEAD)
            lab.sh_result(DEAD, f"docker unpause {RAY_CONTAINER}")
        thawed = time.monotonic()

        def serving_again() -> bool:
            status = served.status()
            return status["replicas"] == 3 and [IP3] in pipeline_ips(status)

        back_s = _seconds_until(serving_again, RETURN_LIMIT_S, "the thawed node serving", thawed)
        before = len(load.answers)
        assert wait_until(lambda: len(load.answers) >= before + 3 * CLIENTS, 300), load.errors
    (first, *_) = failed()
    failed_s = first["at"] - frozen_wall
    events = [e for e in served.status()["events"] if e["at"] >= frozen_wall]
    print(
        f"\n[frozen] pipeline failed {failed_s:.1f} s after the freeze ({first.get('detail')}); fresh answer"
        f" {recovered_s:.1f} s; thawed -> serving again {back_s:.1f} s; {len(load.answers)} answers,"
        f" {len(load.errors)} errors; events {[e['event'] for e in events]}"
    )
    assert load.errors == [] and load.wrong() == []
    assert any(e["event"] == "failover" for e in events)  # requests really were on the frozen node and moved
    assert "did not answer" in str(first.get("detail")), first
    assert failed_s < FROZEN_LIMIT_S, first  # the stall deadline alone: 30 s
