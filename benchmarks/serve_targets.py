"""Issue 31's serving targets on the lab, measured with `bench --serve` against `serve`.

Usage (the lab's name, subnet and node image from the environment, as the lab tests take them):
  RAYCLUSTER_LAB_NAME=rc-sb RAYCLUSTER_LAB_SUBNET=10.81.0.0/24 RAYCLUSTER_NODE_IMAGE=raycluster/node:wt-sb \\
    PYTHONPATH=. python benchmarks/serve_targets.py --quotas 1.0,0.5,0.25 --rounds 3 --out /tmp/serve-targets

1. A 3-host lab with one CPU quota per host, `up`, a random Llama with a real (word-level) tokenizer written here,
   `serve` over every host (one replica of 3 stages, the balanced split by measured speed).
2. Each round on it: a saturation run (every request at once), one request at a time (`--concurrency 1`), and
   four at a time (`--concurrency 4`); with --held also the saturation held (`--concurrency 32`, 96 requests).
3. `down`, then `up` of the fastest host alone (an inventory of its one host) and `serve` there: the same service
   with the whole model on the fastest node; each round a saturation run.
   With --baseline-image TAG (a node image of the code before a change, built as the lab's own): each round also
   serves the 3 hosts from that image, in the other order every round (before, after; after, before; ...), so a
   change is measured against the code before it in the same rounds of a shared machine (`baseline` in the
   summary, and `after_over_before`: the per-round ratio of the saturation throughput).  With --baseline-flags
   FLAGS instead, the "before" service is the same image served with FLAGS added (e.g. --rebalance-period=0: the
   service that does not re-split itself, against the one that does); --serve-flags add to every 3-host serve;
   --warmups N: N saturation runs before the measured ones, not counted (a re-split from the stages' times under
   load happens in them; each run's stages, with their blocks, show the split it ran on).
4. The figures (median and min–max over rounds): 3-host ÷ 1-node saturation throughput (target ≥ 1.3); the share
   of the pipeline ceiling (T_max / wall of the slowest stage, target ≥ 0.9); 4-at-a-time ÷ one-at-a-time
   throughput (≥ 3) and p50 TPOT (≤ 1.5). Every document is kept under --out; the summary is --out/summary.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.serve_checkpoint import write_chat_llama

MODEL_SIZES = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8}


def cli(*args: str, inventory: str | None = None, timeout: float = 1800, check: bool = True) -> dict[str, Any]:
    command = [sys.executable, "-m", "raycluster_cli", *args, "--json"] + (["-i", inventory] if inventory else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    try:
        doc: dict[str, Any] = json.loads(done.stdout)
    except ValueError:
        raise SystemExit(f"{args[:2]}: no JSON (rc {done.returncode}): {done.stderr[-2000:]}") from None
    if check and done.returncode != 0:
        raise SystemExit(f"{args[:2]}: rc {done.returncode}: {json.dumps(doc.get('error'))} {done.stderr[-1500:]}")
    return doc


def machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of this whole machine (/proc/stat's first line): the lab's hosts share its cores."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def bench(inventory: str, out: Path, name: str, requests: int, extra: list[str]) -> dict[str, Any]:
    args = ["bench", "--serve", "--rates=", f"--requests={requests}", *extra]
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    cpu_before = machine_cpu()
    doc = cli(*args, f"--save-result={out / (name + '.json')}", inventory=inventory)
    cpu_after = machine_cpu()
    (run,) = doc["runs"]
    run["load"] = {"before": load_before, "after": Path("/proc/loadavg").read_text().split()[:3]}
    # the whole machine's CPU busy share over the bench command (its start and the service's work): near 1.0, the
    # lab's hosts got less than their quotas, whatever the quotas say
    spent = [a - b for a, b in zip(cpu_after, cpu_before, strict=True)]
    run["machine_cpu_busy"] = round(spent[0] / spent[1], 3) if spent[1] else None
    print(
        f"{name}: {run['output_tokens_per_s']:.1f} tok/s, TPOT p50 {run['latency_s']['tpot']['p50']}, "
        f"of ceiling {run['of_ceiling']}, imbalance {run['imbalance']}, load {run['load']}, "
        f"machine CPU busy {run['machine_cpu_busy']}, stages "
        f"{[(s['pipeline'], s['node_ip'], s['blocks'], round(s['busy_s'], 2)) for s in run['stages']]}, "
        f"Ray's CPU ms per step {[round(1000 * (s['cpu_s'] - s.get('forward_cpu_s', 0)) / max(1, s['steps']), 2) for s in run['stages']]}, "
        f"node CPU ÷ quota {[s.get('node_cpu_share') for s in run['stages']]}, "
        f"anatomy {json.dumps(run.get('anatomy'))}",
        flush=True,
    )
    return run


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rounds: list[dict[str, dict[str, Any]]], single: list[dict[str, Any]]) -> dict[str, Any]:
    sat = [r["saturation"]["output_tokens_per_s"] for r in rounds]
    one = [s["output_tokens_per_s"] for s in single]
    conc1 = [r["one"]["output_tokens_per_s"] for r in rounds]
    conc4 = [r["four"]["output_tokens_per_s"] for r in rounds]
    tpot1 = [r["one"]["latency_s"]["tpot"]["p50"] for r in rounds]
    tpot4 = [r["four"]["latency_s"]["tpot"]["p50"] for r in rounds]
    pairs = list(zip(sat, one, strict=False))
    return {
        "three_hosts_tokens_per_s": _spread(sat),
        "fastest_node_alone_tokens_per_s": _spread(one),
        "three_over_one": _spread([a / b for a, b in pairs]),
        "of_pipeline_ceiling": _spread([r["saturation"]["of_ceiling"] for r in rounds]),
        "imbalance": _spread([r["saturation"]["imbalance"] for r in rounds]),
        "stages_busy_s": [[s["busy_s"] for s in r["saturation"]["stages"]] for r in rounds],
        "four_over_one_throughput": _spread([b / a for a, b in zip(conc1, conc4, strict=True)]),
        "four_over_one_tpot_p50": _spread([b / a for a, b in zip(tpot1, tpot4, strict=True)]),
        "one_at_a_time_tpot_p50_s": _spread(tpot1),
        **(
            {
                "held_tokens_per_s": _spread([r["held"]["output_tokens_per_s"] for r in rounds]),
                "held_of_pipeline_ceiling": _spread([r["held"]["of_ceiling"] for r in rounds]),
                "held_ttft_p50_s": _spread([r["held"]["latency_s"]["ttft"]["p50"] for r in rounds]),
                "held_tpot_p50_s": _spread([r["held"]["latency_s"]["tpot"]["p50"] for r in rounds]),
            }
            if all("held" in r for r in rounds)
            else {}
        ),
        "four_at_a_time_tpot_p50_s": _spread(tpot4),
        "load_before": {  # the machine's 1-minute load average as each run began (it is shared)
            "three": [[r[k]["load"]["before"][0] for k in ("saturation", "one", "four")] for r in rounds],
            "alone": [s["load"]["before"][0] for s in single],
        },
    }


def three_host_round(
    inventory: str,
    model: Path,
    out: Path,
    tag: str,
    number: int,
    requests: int,
    lengths: list[str],
    flags: list[str] = (),  # type: ignore[assignment]
    warmups: int = 0,
    held: bool = False,
) -> dict[str, Any]:
    """`serve` over the 3 hosts (from ``inventory``'s image), then the saturation, one and four at a time."""
    cli("down", inventory=inventory)
    cli("up", inventory=inventory)
    cli("serve", f"--model-path={model}", "--max-seq=256", "--slots=16", *flags, inventory=inventory)
    record = cli("status", inventory=inventory, check=False)["service"]["record"]  # the split, each node's speed
    (out / f"serve-record{tag}-{number}.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"serving{tag}:", json.dumps(record.get("pipelines")), json.dumps(record.get("nodes")), flush=True)
    for warm in range(warmups):
        bench(inventory, out, f"three{tag}-warm{warm}-{number}", 2 * requests, lengths)
    runs = {
        "saturation": bench(inventory, out, f"three{tag}-sat-{number}", requests, lengths),
        "one": bench(inventory, out, f"three{tag}-one-{number}", 8, [*lengths, "--concurrency=1"]),
        "four": bench(inventory, out, f"three{tag}-four-{number}", 16, [*lengths, "--concurrency=4"]),
    }
    if held:  # the saturation held: ``requests`` at a time, three times as many in all
        name = f"three{tag}-held-{number}"
        runs["held"] = bench(inventory, out, name, 3 * requests, [*lengths, f"--concurrency={requests}"])
    cli("serve", "--stop", inventory=inventory)
    return runs


def baseline_inventory(inventory: str, image: str, hosts: int, out: Path) -> str:
    """The same lab with ``image`` loaded into its hosts: an inventory whose `up` starts that image."""
    from raycluster_cli.lab.engines import load_image
    from raycluster_cli.lab.hosts import docker_client, lab_hosts

    load_image(docker_client(), [h.name for h in lab_hosts(hosts)], image)
    data = yaml.safe_load(Path(inventory).read_text())
    data["image"] = image
    path = out / "baseline.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quotas", default="1.0,0.5,0.25")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=32, help="per saturation run")
    p.add_argument("--lengths", default="--prompt-tokens=16:64 --output-tokens=32:96")
    p.add_argument("--out", type=Path, default=Path("/tmp/serve-targets"))
    p.add_argument("--alternate", action="store_true", help="each round: the 3 hosts, then the fastest alone")
    p.add_argument("--baseline-image", default="", help="also serve the 3 hosts from this node image each round")
    p.add_argument("--baseline-flags", default="", help="or: also serve the 3 hosts with these serve flags added")
    p.add_argument("--serve-flags", default="", help="serve flags for every 3-host service")
    p.add_argument("--warmups", type=int, default=0, help="saturation runs before the measured ones, not counted")
    p.add_argument("--held", action="store_true", help="each round also holds the saturation: 3x the requests")
    args = p.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    quotas = args.quotas.split(",")
    cpus = [f"--cpus=lab-h{i + 1}={q}" for i, q in enumerate(quotas)]
    inventory = cli("lab", "up", f"--hosts={len(quotas)}", *cpus)["inventory"]
    model = write_chat_llama(out / "serve-llama", seed=1, **MODEL_SIZES)
    base = baseline_inventory(inventory, args.baseline_image, len(quotas), out) if args.baseline_image else ""
    flags, base_flags = args.serve_flags.split(), [*args.serve_flags.split(), *args.baseline_flags.split()]
    if args.baseline_flags and not base:
        base = inventory
    keep = {"flags": flags, "warmups": args.warmups, "held": args.held}
    before: list[dict[str, dict[str, Any]]] = []
    lengths = args.lengths.split()
    data = yaml.safe_load(Path(inventory).read_text())
    data["hosts"] = data["hosts"][:1]  # lab-h1: the highest quota, the fastest node
    alone = out / "fastest-alone.yaml"
    alone.write_text(yaml.safe_dump(data, sort_keys=False))
    rounds: list[dict[str, dict[str, Any]]] = []
    single: list[dict[str, Any]] = []
    # --alternate: each round is the 3-host service, then the fastest host alone (a load on the shared machine
    # then falls on both); without it every 3-host round comes first, then every alone round (as in session 22).
    blocks = [[n] for n in range(args.rounds)] if args.alternate else [list(range(args.rounds))]
    for block in blocks:
        for number in block:
            earlier = {"flags": base_flags, "warmups": args.warmups, "held": args.held}
            if base and number % 2 == 0:
                before.append(three_host_round(base, model, out, "-before", number, args.requests, lengths, **earlier))
            rounds.append(three_host_round(inventory, model, out, "", number, args.requests, lengths, **keep))
            if base and number % 2 == 1:
                before.append(three_host_round(base, model, out, "-before", number, args.requests, lengths, **earlier))
        cli("down", inventory=inventory)
        cli("up", inventory=str(alone))
        cli("serve", f"--model-path={model}", "--max-seq=256", "--slots=16", inventory=str(alone))
        single += [bench(str(alone), out, f"one-sat-{n}", args.requests, lengths) for n in block]
        cli("serve", "--stop", inventory=str(alone))
        cli("down", inventory=str(alone))
    summary = {"quotas": quotas, "model": MODEL_SIZES, "lengths": lengths} | summarize(rounds, single)
    if before:
        summary["baseline"] = {"image": args.baseline_image, "flags": base_flags} | summarize(before, single)
        sat = [
            (r["saturation"]["output_tokens_per_s"], b["saturation"]["output_tokens_per_s"])
            for r, b in zip(rounds, before, strict=True)
        ]
        summary["after_over_before"] = _spread([a / b for a, b in sat])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
