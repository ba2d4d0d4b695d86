"""Memory as a hard capacity: unit sizes match what a Stage really holds, the split respects each node's room,
a model that fits nowhere is refused with the numbers, and --check-output goes unit by unit when it must."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from raycluster_cli.bench import outputcheck
from raycluster_cli.bench.fitting import MemoryPlan
from raycluster_cli.bench.options import BenchOptions
from raycluster_cli.bench.results import BenchParams
from raycluster_cli.bench.workload import make_prompts
from raycluster_cli.models.decoder import ModelConfig, Stage, config_from_checkpoint, greedy_generate
from raycluster_cli.placement import memory
from raycluster_cli.placement.partition import DoesNotFit, balanced_partition, stage_costs
from tests.llama_checkpoint import GQA, VARIANT, write_llama

GPT2 = ModelConfig(vocab=61, d_model=32, heads=4, layers=3, max_seq=24, seed=3)


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> list[ModelConfig]:
    root = tmp_path_factory.mktemp("memory")
    llama = config_from_checkpoint(write_llama(root / "gqa", **GQA), max_seq=24)
    variant = config_from_checkpoint(write_llama(root / "variant", **VARIANT), max_seq=24)
    qwen2 = config_from_checkpoint(write_llama(root / "qwen2", family="qwen2", **GQA), max_seq=24)
    phi3 = write_llama(root / "phi3", family="phi3", partial_rotary_factor=0.5, **GQA)  # half-width rotary tables
    return [GPT2, llama, variant, qwen2, config_from_checkpoint(phi3, max_seq=24)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unit_bytes_are_what_a_stage_holds(configs: list[ModelConfig], dtype: str) -> None:
    for base in configs:
        cfg = replace(base, dtype=dtype)
        sizes = memory.unit_bytes(cfg)
        for unit in range(cfg.num_units):
            assert Stage(cfg, unit, unit + 1).weight_bytes() == sizes[unit], (cfg.family or cfg.arch, unit)
        stage = Stage(cfg, 1, cfg.num_units)
        stage(torch.randn(3, 5, cfg.d_model), "m", 0)
        assert stage.cache_bytes() == cfg.layers * memory.kv_bytes_per_block(cfg, 3)


def test_cgroup_limits_are_read_as_docker_counts_them() -> None:
    stat_v1 = "cache 100\ntotal_inactive_file 300\ntotal_active_file 20\nrss 5\n"
    assert memory.cgroup_capacity("600000000\n", "400000000\n", stat_v1) == (600_000_000, 400_000_000 - 320)
    assert memory.cgroup_capacity("9223372036854771712\n", "400000000\n", stat_v1) is None  # v1: unlimited
    assert memory.cgroup_capacity("max\n", "4096\n", "inactive_file 96\n") is None  # v2: unlimited
    assert memory.cgroup_capacity("8192\n", "4096\n", "inactive_file 96\n") == (8192, 4000)
    assert memory.cgroup_capacity(None, None, None) is None


def _capacity(ip: str, usable: int) -> memory.Capacity:
    return memory.Capacity(f"id-{ip}", ip, usable, usable * 2, usable, "cgroup v1")


def test_a_model_larger_than_every_node_together_is_refused_with_the_numbers() -> None:
    cfg = replace(GPT2, d_model=256, layers=8)
    need = memory.demand(cfg, rows=4, tokens=8)
    caps = [_capacity("10.0.0.1", need.total // 4), _capacity("10.0.0.2", need.total // 4)]
    with pytest.raises(memory.ModelTooLarge) as exc:
        memory.check_fits(need, caps, stages=2)
    text = str(exc.value)
    assert "\n" not in text and memory.gb(need.total) in text
    assert f"10.0.0.1 {memory.gb(need.total // 4)}" in text and "10.0.0.2" in text
    memory.check_fits(need, [_capacity("10.0.0.1", need.total), _capacity("10.0.0.2", need.total)], stages=2)


def test_the_fastest_split_that_breaks_memory_is_not_chosen() -> None:
    """Node 0 is ten times faster: by speed it takes nearly every block, but it holds only two."""
    rows = [[0.1] + [1.0] * 8 + [0.1], [1.0] + [10.0] * 8 + [1.0]]
    by_speed = balanced_partition(rows)
    assert by_speed[0][1] - 1 >= 6  # speed alone gives node 0 six or more blocks
    sizes = [10] + [100] * 8 + [10]
    chosen = balanced_partition(rows, unit_bytes=sizes, capacity=[215, 10_000])
    assert chosen == [(0, 3), (3, 10)] and sum(sizes[0:3]) <= 215
    assert max(stage_costs(rows, chosen)) > max(stage_costs(rows, by_speed))  # slower, but it fits
    with pytest.raises(DoesNotFit, match=r"fits the nodes' memory.*0\.00 GB, 0\.00 GB"):
        balanced_partition(rows, unit_bytes=sizes, capacity=[215, 500])
    with pytest.raises(ValueError, match="go together"):
        balanced_partition(rows, unit_bytes=sizes)


def test_memory_plan_splits_within_capacity_and_explains_what_does_not_fit() -> None:
    cfg = replace(GPT2, layers=6)
    options = BenchOptions(micro_batch=2, prompt_len=8, max_new_tokens=4, in_flight=3)
    need = memory.demand(cfg, rows=6, tokens=8)
    tight = need.fixed + need.units[0] + 2 * need.units[1]  # the embedding and two blocks
    caps = [_capacity("10.0.0.1", tight).to_dict(), _capacity("10.0.0.2", 10 * need.total).to_dict()]
    plan = MemoryPlan.make(cfg, options, 2, caps)
    assert plan.need == need and plan.need.rows == 6
    ids = ["id-10.0.0.1", "id-10.0.0.2"]
    rows = [[0.01] * cfg.num_units, [1.0] * cfg.num_units]  # node 0 is far faster
    ranges = plan.balanced(rows, 0.0, ids)
    assert ranges == [(0, 3), (3, cfg.num_units)]
    assert plan.why_not(ranges, ids) is None
    assert "stage 0 (units 0-3) needs" in str(plan.why_not([(0, 4), (4, 8)], ids))
    assert plan.calibration_blocks("id-10.0.0.1") == 1 and plan.calibration_blocks("id-10.0.0.2") == 4
    stages = [
        {"replica": 0, "index": i, "node_ip": f"10.0.0.{i + 1}", "node_id": ids[i], "units": list(r)}
        for i, r in enumerate(ranges)
    ]
    report = plan.report(stages)
    assert report["model_bytes"] == sum(memory.unit_bytes(cfg)) and report["stages"][0]["capacity_bytes"] == tight
    assert report["stages"][0]["planned_bytes"] == need.stage(0, 3) <= tight
    with pytest.raises(memory.ModelTooLarge, match="no split of the model over 2 stage"):
        plan.balanced(rows, 0.0, [ids[0], ids[0]])


def test_output_check_goes_unit_by_unit_when_the_model_does_not_fit(configs: list[ModelConfig]) -> None:
    cfg = configs[1]
    params = BenchParams(requests=4, prompt_len=5, max_new_tokens=6, micro_batch=2, seed=1)
    prompts = make_prompts(cfg.vocab, params.requests, params.prompt_len, params.seed)
    model = Stage(cfg, 0, cfg.num_units)
    tokens = greedy_generate([model], prompts, params.max_new_tokens).tolist()
    result: Any = SimpleNamespace(groups=[[0, 1], [2, 3]], tokens=tokens)
    whole = outputcheck.check_output(cfg, params, result, num_requests=4)
    assert whole == {"identical": True, "compared_requests": 4, "mismatched": []}
    largest = max(memory.demand(cfg, 2, 11).units) + memory.demand(cfg, 2, 11).fixed
    by_unit = outputcheck.check_output(cfg, params, result, num_requests=4, room=largest)
    assert by_unit == {**whole, "method": "unit by unit, teacher-forced"}
    result.tokens[3][2] = (result.tokens[3][2] + 1) % cfg.vocab  # a wrong token is caught, unit by unit too
    assert outputcheck.check_output(cfg, params, result, num_requests=4, room=largest)["mismatched"] == [3]
    skipped = outputcheck.check_output(cfg, params, result, num_requests=4, room=1000)
    assert skipped["identical"] is None and "does not fit the driver's memory" in skipped["skipped"]


def test_node_capacity_reads_this_machine() -> None:
    from raycluster_cli.node.cgroup import container_memory, node_capacity

    cap = node_capacity("n", "127.0.0.1")
    assert cap.source in ("cgroup v2", "cgroup v1", "host") and cap.usable >= 0
    if cap.limit is not None:
        assert cap.usable <= cap.limit - cap.used
    assert set(container_memory()) == {"limit_bytes", "working_set_bytes", "peak_bytes", "oom_kills"}


def test_oom_kills_are_read_from_either_cgroup_version() -> None:
    from raycluster_cli.node.cgroup import oom_kills

    v2 = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n"
    v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"
    assert (oom_kills(v2), oom_kills(v1), oom_kills(None), oom_kills("oom 1\n")) == (2, 5, None, None)


def test_output_check_in_bfloat16_takes_tokens_among_the_references_top_k(configs: list[ModelConfig]) -> None:
    """Reduced precision: teacher-forced, a token the reference ranks second passes the tolerance (not identity),
    one outside its top 5 fails it. The tokens are the reference's own greedy choices, made one position at a
    time with the same teacher-forced pass (so every one is its argmax)."""
    cfg = replace(configs[1], dtype="bfloat16")
    params = BenchParams(requests=4, prompt_len=5, max_new_tokens=4, micro_batch=2, seed=1)
    prompts = make_prompts(cfg.vocab, params.requests, params.prompt_len, params.seed)
    tokens = torch.zeros(4, params.max_new_tokens, dtype=torch.long)
    for j in range(params.max_new_tokens):
        logits = outputcheck._teacher_forced_logits(cfg, torch.cat([prompts, tokens], 1), params.prompt_len)
        tokens[:, j] = logits[:, j].float().argmax(-1)
    result: Any = SimpleNamespace(groups=[[0, 1], [2, 3]], tokens=tokens.tolist())

    def within() -> dict[str, Any]:
        tolerance: dict[str, Any] = outputcheck._within_tolerance(cfg, prompts, result, result.groups, 5)
        return tolerance

    assert within() == {
        "dtype": "bfloat16", "top_k": 5, "positions": 16, "argmax_agreed": 1.0, "outside_top_k": [], "within": True,
    }  # fmt: skip
    ranked = logits[1, -1].float().argsort(descending=True).tolist()
    result.tokens[1][-1] = ranked[1]  # the last token (nothing after it depends on it): the reference's second
    second = within()
    assert second["within"] is True and second["argmax_agreed"] == 15 / 16 and second["outside_top_k"] == []
    result.tokens[1][-1] = ranked[20]  # well outside the top 5
    assert within()["outside_top_k"] == [1] and within()["within"] is False

    # Through check_output: the strict comparison first (the whole model decoding the same micro-batches); a
    # request it rejects in reduced precision gets the tolerance's verdict beside the strict one.
    checked = outputcheck.check_output(cfg, params, result, num_requests=4)
    assert checked["identical"] is False and 1 in checked["mismatched"]
    assert checked["tolerance"]["outside_top_k"] == [1] and checked["tolerance"]["within"] is False
    in_float32 = outputcheck.check_output(replace(cfg, dtype="float32"), params, result, num_requests=4)
    assert "tolerance" not in in_float32  # float32 is held to identity alone
