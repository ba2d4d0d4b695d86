"""What the tests/local text-service tests share: a plain HTTP call, the reference greedy answer from
``transformers``, the service's idle counters (its status, its replica's Serve count, its Prometheus gauges), and
a poll with a deadline.  Real parts only: ``transformers`` on the test's own checkpoint, Ray's own actors."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .text_tokenizers import in_context

SERVE_NAMESPACE = "serve"  # Ray Serve's actors (controller, proxies, replicas) live here
INGRESS_REPLICA = "SERVE_REPLICA::raycluster#OpenAIServer#"  # the text ingress's replica actors' name prefix
GAUGES = (
    "raycluster_serve_requests_running",
    "raycluster_serve_requests_waiting",
    "raycluster_serve_kv_slots_used_ratio",
    "raycluster_serve_kv_tokens_used_ratio",
    "raycluster_serve_outstanding_tokens",
)


def raw(url: str, body: bytes | None = None, token: str | None = None, timeout_s: float = 30) -> tuple[int, Any]:
    """A plain HTTP call (no client library): the status and the JSON body (0 and {} when nothing answered)."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {}
    except (OSError, ValueError):
        return 0, {}


def wait_until(check: Callable[[], Any], deadline_s: float, what: str, period_s: float = 0.2) -> float:
    """Poll ``check`` until it is true (an ``OSError`` counts as not yet); the seconds it took."""
    began = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - began
        except OSError:
            pass
        if time.monotonic() - began > deadline_s:
            raise TimeoutError(f"{what}: not after {deadline_s} s")
        time.sleep(period_s)


@dataclass
class Greedy:
    """``transformers``' own greedy answers on the checkpoint at ``path``, each prompt's computed once."""

    path: Path
    new_tokens: int
    _cache: dict[str, str] = field(default_factory=dict)
    _loaded: tuple[Any, Any] | None = None

    def __call__(self, prompt: str) -> str:
        if prompt not in self._cache:
            import torch
            import transformers

            if self._loaded is None:
                tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.path))
                self._loaded = tokenizer, transformers.AutoModelForCausalLM.from_pretrained(str(self.path)).eval()
            tokenizer, model = self._loaded
            ids = tokenizer.encode(prompt)
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=self.new_tokens)
            self._cache[prompt] = in_context(tokenizer, ids, out[0, len(ids) :].tolist())
        return self._cache[prompt]


def ingress_ongoing() -> list[int]:
    """Each live text-ingress replica's requests in flight as Ray Serve counts them (what its max_ongoing bounds),
    asked of the replica actors themselves."""
    import ray

    counts: list[int] = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == SERVE_NAMESPACE and entry["name"].startswith(INGRESS_REPLICA):
            actor = ray.get_actor(entry["name"], namespace=SERVE_NAMESPACE)
            ongoing: Any = ray.get(actor.get_num_ongoing_requests.remote(), timeout=10)
            counts.append(int(ongoing))
    return counts


def busy_in_status(status: dict[str, Any]) -> list[str]:
    """What the service's status still holds for requests, pipeline by pipeline (empty: idle): requests, waiting
    and running ones, KV positions, outstanding tokens, and each key's requests and tokens in flight."""
    held = [
        f"pipeline {p['index']}: {name} {p[name]}"
        for p in status["pipelines"]
        for name in ("requests", "waiting", "running", "kv_used_tokens", "outstanding_tokens")
        if p[name]
    ]
    keys = {name: flight for name, flight in status.get("keys_in_flight", {}).items() if any(flight.values())}
    return held + ([f"keys in flight: {keys}"] if keys else [])


def gauges(metrics_url: str) -> dict[str, float]:
    """The service's pipeline gauges as Prometheus reads them from the node's metrics agent (Ray prefixes
    ``ray_``), summed over the pipelines; {} while the agent has none of them yet."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for name in GAUGES:
        for value in re.findall(rf"^ray_{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.MULTILINE):
            found[name] = found.get(name, 0.0) + float(value)
    return found


def actor_pid(name_prefix: str, namespace: str = SERVE_NAMESPACE) -> int:
    """The process id of the one live actor of this Ray whose name starts with ``name_prefix`` (Ray Serve's
    controller ``SERVE_CONTROLLER_ACTOR``, a proxy ``SERVE_PROXY_ACTOR-``, the ingress ``INGRESS_REPLICA``), as
    Ray's actor table records it: what a test kills to crash that process for real."""
    import ray

    names = {e["name"] for e in ray.util.list_named_actors(all_namespaces=True) if e["namespace"] == namespace}
    found = [
        int(a["Pid"])
        for a in ray._private.state.actors().values()  # the GCS's table: every actor this Ray ran, with its pid
        if a["State"] == "ALIVE" and a["Name"].startswith(name_prefix) and a["Name"] in names
    ]
    assert len(found) == 1, f"{len(found)} live actors named {name_prefix}*"
    return found[0]


def live_actors(class_name: str) -> int:
    """How many actors of ``class_name`` are alive in this Ray (the stages of every pipeline: ``StageActor``)."""
    import ray

    table = ray._private.state.actors().values()
    return sum(1 for a in table if a["State"] == "ALIVE" and a["ActorClassName"].endswith(class_name))
