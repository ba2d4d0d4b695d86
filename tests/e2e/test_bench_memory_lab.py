"""Memory as a hard capacity on the real 3-host lab: the Ray containers get ``--memory`` limits, a checkpoint
at least 1.5x any one node's limit is benchmarked across the nodes without an OOM, and a model larger than the
whole cluster is refused at once with the numbers.

The limit leaves room for Ray's own processes (measured on the lab: see LIMIT) and the checkpoint is a random
GPT-2 made big by its width, written by the test on every host (in the node image, where torch is).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import DOCKER, Lab

pytestmark = [pytest.mark.lab, pytest.mark.slow]

MODEL_DIR = "/srv/raycluster-bench/wide-gpt2"
HUGE_DIR = "/srv/raycluster-bench/huge-gpt2"
MIB = 1 << 20
# Every Ray container's memory limit. Measured on the lab before any model (cgroup working set, session 30):
# the head holds ~1.05 GB of Ray's own (GCS, dashboard and its modules, agents, the bench driver, idle workers),
# a worker ~0.5 GB with its stage worker; Ray's memory monitor kills workers above 95 % of the limit.
LIMIT = 2400 * MIB
WIDE = {"layers": 19, "d_model": 2048, "vocab": 256, "positions": 64}  # 3.8 GB in float32: 1.52x a node's limit
HUGE = {"layers": 40, "d_model": 2048, "vocab": 256, "positions": 64}  # 8 GB: more than the three limits together

# Runs in the node image on each lab host (torch is there): a random GPT-2 streamed tensor by tensor into a
# safetensors file (the same seed gives every host the same bytes), or with SPARSE=1 a file of zeros whose
# data is a hole (a valid checkpoint that takes no disk). One tensor in memory at a time.
WRITER = r"""
import json, os, struct, sys, torch
out, sparse = sys.argv[1], sys.argv[2] == "1"
layers, d, vocab, positions = (int(v) for v in sys.argv[3:7])
shapes = {"wte.weight": (vocab, d), "wpe.weight": (positions, d)}
for i in range(layers):
    p = f"h.{i}."
    shapes |= {p + "ln_1.weight": (d,), p + "ln_1.bias": (d,), p + "attn.c_attn.weight": (d, 3 * d),
               p + "attn.c_attn.bias": (3 * d,), p + "attn.c_proj.weight": (d, d), p + "attn.c_proj.bias": (d,),
               p + "ln_2.weight": (d,), p + "ln_2.bias": (d,), p + "mlp.c_fc.weight": (d, 4 * d),
               p + "mlp.c_fc.bias": (4 * d,), p + "mlp.c_proj.weight": (4 * d, d), p + "mlp.c_proj.bias": (d,)}
shapes |= {"ln_f.weight": (d,), "ln_f.bias": (d,)}
header, offset = {}, 0
for name, shape in shapes.items():
    size = 4 * torch.Size(shape).numel()
    header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
encoded = json.dumps(header, separators=(",", ":")).encode()
encoded += b" " * (-len(encoded) % 8)
os.makedirs(out, exist_ok=True)
gen = torch.Generator().manual_seed(0)
with open(os.path.join(out, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(encoded)) + encoded)
    if sparse:
        f.truncate(8 + len(encoded) + offset)
    else:
        for name, shape in shapes.items():
            std = 0.5 if name.startswith("wte") else (0.1 if "ln_" in name else 0.2 / d ** 0.5 * 8)
            t = torch.randn(shape, generator=gen) * std + (1.0 if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight" else 0.0)
            f.write(t.numpy().tobytes())
config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab, "n_positions": positions,
          "n_ctx": positions, "n_embd": d, "n_layer": layers, "n_head": 16, "activation_function": "gelu_new",
          "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f)
"""


def _write_checkpoint(lab: Lab, hostname: str, image: str, folder: str, shape: dict[str, int], sparse: bool) -> None:
    args = [str(shape[k]) for k in ("layers", "d_model", "vocab", "positions")]
    command = (
        f"rm -rf {folder} && mkdir -p {folder} && docker run --rm -i -v {folder}:{folder} --entrypoint python"
        f" {image} - {folder} {int(sparse)} {' '.join(args)}"
    )
    done = subprocess.run(
        [DOCKER, "exec", "-i", lab.host(hostname).name, "sh", "-c", command],
        input=WRITER,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def limited(lab_hosts: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The lab's cluster with memory-limited Ray containers, the wide checkpoint on every host and the huge one
    (sparse) on the head, whose driver reads its config."""
    root = tmp_path_factory.mktemp("memory-lab")
    image = str(yaml.safe_load(Path(lab_hosts.inventory).read_text())["image"])
    with ThreadPoolExecutor(3) as pool:
        writes = [
            pool.submit(_write_checkpoint, lab_hosts, h.hostname, image, MODEL_DIR, WIDE, False)
            for h in lab_hosts.info.hosts
        ]
        for write in writes:
            write.result()
    _write_checkpoint(lab_hosts, lab_hosts.info.hosts[0].hostname, image, HUGE_DIR, HUGE, True)

    def limit(inventory: dict[str, Any]) -> None:
        inventory["ray"]["object_store_memory"] = 80_000_000
        for host in inventory["hosts"]:
            host.setdefault("docker", {})["run_options"] = [
                f"--memory={LIMIT}",
                f"--memory-swap={LIMIT}",
                "--volume=/srv/raycluster-bench:/srv/raycluster-bench:ro",
            ]

    variant = lab_hosts.variant(root / "limited.yaml", limit)
    code, doc, err = lab_hosts.cli("up", inventory=variant, timeout=900)
    assert code == 0, err
    assert all(n["alive"] for n in doc["nodes"])
    yield variant
    lab_hosts.cli("down", inventory=variant, timeout=600)
    for host in lab_hosts.info.hosts:
        lab_hosts.sh_result(host.hostname, f"rm -rf {MODEL_DIR} {HUGE_DIR}")


def test_a_checkpoint_larger_than_any_node_runs_across_them(lab_hosts: Lab, limited: str) -> None:
    code, doc, err = lab_hosts.cli(
        "bench",
        f"--model-path={MODEL_DIR}",
        "--dtype=float32",
        "--requests=8",
        "--micro-batch=2",
        "--in-flight=3",
        "--prompt-len=8",
        "--max-new-tokens=4",
        "--refine=0",
        "--calibration-repeats=1",
        "--calibration-sample-s=0.05",
        "--check-output",
        "--check-requests=2",
        "--no-network-check",
        inventory=limited,
        timeout=1500,
    )
    assert code == 0, f"{doc}\n{err[-3000:]}"
    memory = doc["memory"]
    assert memory["dtype"] == "float32" and memory["model_bytes"] >= 1.5 * LIMIT
    assert doc["completed"] == 8 and not doc["lost_nodes"] and not doc["lost_in_run"]
    stages = memory["stages"]
    for stage in stages:  # the figures for docs/PERFORMANCE.md
        print(
            {
                k: stage[k]
                for k in (
                    "node_ip",
                    "limit_bytes",
                    "used_before_bytes",
                    "capacity_bytes",
                    "planned_bytes",
                    "weights_bytes",
                    "working_set_bytes",
                    "process_peak_rss_bytes",
                )
            },
            file=sys.stderr,
        )
    print({k: v for k, v in memory.items() if k != "stages"}, doc["tokens_per_s"], doc["output_check"], file=sys.stderr)
    assert len({s["node_ip"] for s in stages}) == 3
    for stage in stages:
        assert stage["source"] == "cgroup v1" or stage["source"] == "cgroup v2"
        assert stage["limit_bytes"] == LIMIT
        assert stage["planned_bytes"] <= stage["capacity_bytes"] < stage["limit_bytes"]
        assert stage["weights_bytes"] <= stage["planned_bytes"]  # the plan covers what the stage really holds
        # what the container holds after the run: below Ray's kill threshold, and what the plan foresaw
        assert stage["working_set_bytes"] <= 0.95 * LIMIT
        assert stage["working_set_bytes"] <= stage["used_before_bytes"] + stage["planned_bytes"] + 0.03 * LIMIT
        assert stage["weights_bytes"] < stage["process_peak_rss_bytes"] <= LIMIT  # the worker held its weights
    assert sum(s["weights_bytes"] for s in stages) == memory["model_bytes"]
    assert "fits no node's memory" in doc["references"]["unsharded"]["skipped"]
    check = doc["output_check"]
    assert check.get("identical") is True or "skipped" in check, check


def _timed_bench(lab: Lab, inventory: str, model: str) -> tuple[float, int, dict[str, Any]]:
    began = time.monotonic()
    code, doc, _ = lab.cli(
        "bench", f"--model-path={model}", "--dtype=float32", "--no-network-check", inventory=inventory
    )
    return time.monotonic() - began, code, doc


def test_a_model_larger_than_the_cluster_is_refused_at_once_with_the_numbers(lab_hosts: Lab, limited: str) -> None:
    """Refused within 10 s of what any bench takes to reach its driver: the reference is a bench whose model
    folder does not exist (it fails in the driver before Ray is asked), timed in the same run."""
    reference_s, code, doc = _timed_bench(lab_hosts, limited, "/srv/raycluster-bench/no-such-model")
    assert code == 1 and "config.json not found" in str(doc), doc
    elapsed, code, doc = _timed_bench(lab_hosts, limited, HUGE_DIR)
    assert code == 1, doc
    message = str(doc["error"]["message"])
    assert "does not fit the nodes' memory" in message and "usable per node" in message, doc
    assert message.count(" GB") >= 4 and "\n" not in message  # the model's bytes and each node's, one line
    print(
        f"refused after {elapsed:.1f}s; a bench failing in its driver before Ray: {reference_s:.1f}s", file=sys.stderr
    )
    assert elapsed - reference_s < 10, (elapsed, reference_s)
