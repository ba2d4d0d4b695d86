"""What our ingress sends vLLM (the prompt's ids, the sampling under vLLM's names) and how a vLLM server is
launched (its own Python, loopback, the key in its environment, a refusal that names the fix)."""

from __future__ import annotations

import pytest

from raycluster_cli.node.vllm_server import LAUNCH, LAUNCH_HEADLESS, VllmLaunch, VllmRank
from raycluster_cli.serve.live import BadInput
from raycluster_cli.serve.options import ServeOptions, ValidationError, problem
from raycluster_cli.serve.text import Sampling
from raycluster_cli.serve.vllm_engine import completion_body


def test_greedy_body_sends_the_ids_and_asks_for_token_ids() -> None:
    body = completion_body("m", [5, 6, 7], 12, Sampling(temperature=0.0), None)
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 12 and body["temperature"] == 0.0
    assert body["return_token_ids"] is True
    assert "top_k" not in body and "seed" not in body and "stop" not in body and "logit_bias" not in body


def test_every_sampling_setting_goes_under_vllm_s_name() -> None:
    sampling = Sampling(
        temperature=0.8, top_p=0.9, seed=7, ignore_eos=True, top_k=20, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=0.25, repetition_penalty=1.1, logit_bias=((3, -100.0),), min_tokens=2,
        include_stop_str_in_output=True,
    )  # fmt: skip
    body = completion_body("m", [1], 4, sampling, ["\n"])
    expected = {
        "top_p": 0.9, "seed": 7, "ignore_eos": True, "top_k": 20, "min_p": 0.05, "presence_penalty": 0.5,
        "frequency_penalty": 0.25, "repetition_penalty": 1.1, "logit_bias": {"3": -100.0}, "min_tokens": 2,
        "include_stop_str_in_output": True, "stop": ["\n"],
    }  # fmt: skip
    assert {k: body[k] for k in expected} == expected


def test_logprobs_are_refused_naming_the_field() -> None:
    with pytest.raises(BadInput, match="logprobs") as refused:
        completion_body("m", [1], 4, Sampling(logprobs=2), None)
    assert refused.value.param == "logprobs"


def test_a_missing_vllm_python_names_the_flag_and_how_to_install() -> None:
    with pytest.raises(ValueError, match=r"--vllm-python '/nowhere/python'.*benchmarks/vllm_cpu_env.sh"):
        VllmLaunch(python="/nowhere/python", model_path="/m", served_model="m").check()


def test_the_server_listens_on_loopback_and_its_key_is_not_on_its_command_line() -> None:
    command = VllmLaunch(
        python="/v/bin/python", model_path="/m", served_model="tiny", args=("--enforce-eager",)
    ).command(8123)
    assert command[:4] == ["/v/bin/python", "-c", LAUNCH, "vllm.entrypoints.openai.api_server"]
    assert "--host=127.0.0.1" in command and "--port=8123" in command and "--enforce-eager" in command
    assert not any("api-key" in part for part in command)


def test_engine_vllm_without_its_python_is_one_line_naming_the_flag() -> None:
    with pytest.raises(ValidationError) as refused:
        ServeOptions(engine="vllm")
    assert (
        problem(refused.value)[0] == "--engine vllm needs --vllm-python: a python with vllm or vllm-cpu on every node"
    )
    with pytest.raises(ValidationError) as unknown:
        ServeOptions(engine="sglang")
    assert problem(unknown.value) == ("--engine 'sglang' is not one of ours, vllm", "--engine")
    assert ServeOptions(engine="vllm", vllm_python="/v/bin/python").vllm_python == "/v/bin/python"


def test_a_pipeline_rank_s_command_pins_its_stage_by_node_rank() -> None:
    launch = VllmLaunch(python="/v/bin/python", model_path="/m", served_model="tiny")
    head = launch.command(8123, VllmRank(0, 3, "10.0.0.10", 29500))
    third = launch.command(0, VllmRank(2, 3, "10.0.0.10", 29500))
    assert head[3] == "vllm.entrypoints.openai.api_server" and "--headless" not in head
    assert "--node-rank=0" in head and "--nnodes=3" in head and "--pipeline-parallel-size=3" in head
    assert third[:5] == ["/v/bin/python", "-c", LAUNCH_HEADLESS, "serve", "/m"]
    assert "--node-rank=2" in third and "--master-addr=10.0.0.10" in third and "--master-port=29500" in third
    assert "--headless" in third and not any(part.startswith("--port") for part in third)
    assert "--distributed-executor-backend=mp" in third  # vLLM's Ray backend refuses CPUs


def test_the_launcher_reports_a_vllm_pipeline_as_stages_with_their_layers() -> None:
    from raycluster_cli.models.config import ModelConfig
    from raycluster_cli.placement.pipelines import NodeSpeed
    from raycluster_cli.placement.vllm_split import VllmNode, vllm_split
    from raycluster_cli.serve.__main__ import _vllm_report
    from raycluster_cli.serve.settings import ServeSettings

    cfg = ModelConfig(arch="llama", activation="silu", vocab=100, d_model=64, heads=2, layers=4, max_seq=64)
    nodes = [VllmNode(NodeSpeed(f"n{i}", f"10.0.0.{i}", (0.1, *[s] * 4, 0.1)), 10**10, 10**10) for i, s in ((1, 1.0), (2, 3.0))]  # fmt: skip
    split = vllm_split(cfg, nodes, 256)
    settings = ServeSettings(model_path="/m/tiny", vllm_pipelines=(split.node_ids,), vllm_split=split)
    report = _vllm_report("http://h:8000/v1", settings, cfg.layers)
    stages = report["pipelines"][0]["stages"]
    assert [(s["node_ip"], s["blocks"]) for s in stages] == [("10.0.0.1", 3), ("10.0.0.2", 1)]
    assert report["split"] == [3, 1] and report["engine"] == "vllm" and report["replicas"] == 1
    alone = _vllm_report("u", ServeSettings(model_path="/m/tiny", vllm_nodes=("a", "b")), 4)
    assert [p["stages"][0]["node_id"] for p in alone["pipelines"]] == ["a", "b"] and alone["split"] is None
