"""The launcher's options (JSON of serve/options.py's LaunchOptions, from `raycluster serve`'s flags) and its one
JSON line (what the operator-side ``raycluster serve`` reads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from raycluster_cli.config import inventory
from raycluster_cli.host.containers import REVIVE_RECORD
from raycluster_cli.placement.pipelines import NodeSpeed, plan_replicas
from raycluster_cli.serve.__main__ import _report, _settings, http_options, read_options
from raycluster_cli.serve.options import LaunchOptions
from raycluster_cli.serve.settings import ServeSettings
from raycluster_cli.verbs import serve
from raycluster_cli.verbs.serve_keys import KEYS_IN_CONTAINER

from .test_serve_verb import INVENTORY, _flags


def test_cli_flags_reach_the_launchers_settings_through_one_json_document(tmp_path: Path) -> None:
    """`raycluster serve`'s flags -> ServeOptions -> the JSON the operator writes in the head's container -> the
    launcher's LaunchOptions -> the deployment's ServeSettings: every value the operator gave arrives as given."""
    from raycluster_cli.cli.serve import serve_options

    argv = [
        "--model-path", "./tiny", "--port", "8443", "--stages", "2", "--slots", "4", "--max-seq", "96",
        "--model-id", "chat", "--dtype", "bfloat16", "--steps-in-flight", "3", "--links", "ray",
        "--rebalance-period", "7.5", "--key-max-requests", "5", "--key-max-tokens", "900", "--image-steps", "8",
    ]  # fmt: skip
    options = serve_options(_flags(*argv))
    inv = inventory.parse(INVENTORY, "inv.yaml")
    document = serve.launch_options(inv, "/run/raycluster/models/abc", options, ("/t/c.pem", "/t/k.pem"))
    (tmp_path / "options.json").write_text(document.model_dump_json())
    for given in (f"@{tmp_path / 'options.json'}", document.model_dump_json()):
        launch = read_options(["--options", given])
        assert launch == document
    settings = _settings(launch, "/tmp/raycluster-serve-keys.json")
    assert (settings.model_path, settings.model_id, settings.stages) == ("/run/raycluster/models/abc", "chat", 2)
    assert (settings.limits.slots, settings.limits.max_seq, settings.limits.prefill_chunk) == (4, 96, 64)
    assert (settings.max_in_flight, settings.links, settings.rebalance_period_s) == (3, "ray", 7.5)
    assert (settings.key_max_requests, settings.key_max_tokens) == (5, 900)
    assert settings.keys_file == "/tmp/raycluster-serve-keys.json" and settings.replace_period_s == 30.0
    assert (launch.dtype, launch.image_steps, launch.host) == ("bfloat16", 8, "192.0.2.10")
    assert http_options(launch) == {
        "host": "192.0.2.10", "port": 8443, "ssl_certfile": "/t/c.pem", "ssl_keyfile": "/t/k.pem"
    }  # fmt: skip
    # the defaults the CLI leaves are the launcher's: the same fields, one default each
    plain = read_options(
        ["--options", serve.launch_options(inv, "/m", serve_options(_flags("--model-path", "x"))).model_dump_json()]
    )
    defaults = LaunchOptions(
        model_path="/m", host="192.0.2.10", keys_file=KEYS_IN_CONTAINER, record=serve.RECORD, revive=REVIVE_RECORD
    )
    assert plain == defaults


def test_a_bad_launcher_option_is_one_line_naming_its_flag(tmp_path: Path) -> None:
    def refused(text: str) -> str:
        with pytest.raises(SystemExit) as stopped:
            read_options(["--options", text])
        return str(stopped.value.code)

    assert refused('{"model_path": "/m", "dtype": "fp8"}') == (
        "serve: --dtype 'fp8' is not one of auto, float32, bfloat16, float16 (serve/options.py's LaunchOptions says"
        " what --dtype takes)"
    )
    assert refused('{"model_path": "/m", "split": "2,x"}').startswith("serve: --split '2,x': blocks per stage")
    assert refused('{"model_path": "/m", "slots": -1}').startswith("serve: --slots -1: Input should be greater")
    assert refused('{"model_path": "/m", "new_knob": 1}').startswith("serve: --new-knob is not an option of this")
    assert refused("{}").startswith("serve: --model-path is missing")
    assert (
        refused(f"@{tmp_path / 'none.json'}")
        == f"serve: --options @{tmp_path / 'none.json'}: No such file or directory"
    )
    assert "\n" not in refused("{not json")


def test_the_json_line_names_url_model_replicas_and_each_replica_s_split() -> None:
    speeds = [NodeSpeed(f"n{i}", f"10.0.0.{i}", (0.1, *([float(i)] * 4), 0.1)) for i in (1, 2, 3, 4)]
    plans = plan_replicas(speeds, stages=2)
    settings = ServeSettings(
        model_path="/models/tiny", plans=tuple(plans), speeds=tuple(speeds), stages=2, dtype="bfloat16"
    )
    line = json.loads(json.dumps(_report("http://10.0.0.1:8000/v1", settings, 4)))
    assert set(line) == {"url", "model", "replicas", "split", "pipelines", "nodes", "why", "dtype", "quantize"}
    assert line["model"] == "tiny" and line["replicas"] == 2 and line["dtype"] == "bfloat16"
    assert line["quantize"] == "none"
    assert line["split"] == [list(r) for r in plans[0].ranges]
    stage = line["pipelines"][0]["stages"][0]
    assert set(stage) == {"units", "blocks", "node_ip", "node_id", "stage_s"}
    assert sum(s["blocks"] for s in line["pipelines"][1]["stages"]) == 4
    assert "replica(s)" in line["why"] and line["nodes"][0]["block_s"] == 1.0


def test_the_service_re_splits_itself_unless_told_not_or_given_a_split() -> None:
    def period(**given: object) -> float:
        return _settings(
            LaunchOptions.model_validate({"model_path": "/m", "no_auth": True, **given}), None
        ).rebalance_period_s

    assert period() == 20.0 and period(rebalance_period=5) == 5.0 and period(rebalance_period=0) == 0
    assert period(stages=2, split="2,1") == 0.0  # the operator's split is kept as given
    steps = _settings(LaunchOptions(model_path="/m", steps_in_flight=4), None).max_in_flight
    assert steps == 4 and _settings(LaunchOptions(model_path="/m"), None).max_in_flight is None


def test_max_seq_defaults_to_the_checkpoints_positions_capped_and_a_longer_one_names_the_flag(tmp_path: Path) -> None:
    from raycluster_cli.models.decoder import config_from_checkpoint
    from raycluster_cli.serve.__main__ import default_max_seq

    from ..serve_checkpoint import write_chat_llama

    small = write_chat_llama(tmp_path / "small")  # 256 positions
    assert LaunchOptions(model_path="/m").max_seq == 0
    assert default_max_seq(str(small)) == 256
    assert config_from_checkpoint(small, max_seq=default_max_seq(str(small))).max_seq == 256  # serves by default
    with pytest.raises(ValueError, match="exceed the model's 256 positions: pass --max-seq 256"):
        config_from_checkpoint(small, max_seq=512)
    for name, raw in {"llama3": {"max_position_embeddings": 131072}, "gpt2": {"n_positions": 1024}}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
    assert default_max_seq(str(tmp_path / "llama3")) == 4096 and default_max_seq(str(tmp_path / "gpt2")) == 1024


def test_the_kv_budget_defaults_to_16_full_sequences_and_slots_to_one_per_256_of_its_tokens(tmp_path: Path) -> None:
    """The defaults reserve what 16 full-context slots did, as tokens shared by up to 256 rows; a budget below one
    sequence at --max-seq is refused naming --kv-tokens; the settings carry both to the scheduler."""
    from raycluster_cli.serve.__main__ import resolved

    path = str(tmp_path)
    options = resolved(LaunchOptions(model_path=path, max_seq=4096))
    assert (options.kv_tokens, options.slots) == (16 * 4096, 256)
    small = resolved(LaunchOptions(model_path=path, max_seq=512))
    assert (small.kv_tokens, small.slots) == (8192, 32)
    given = resolved(LaunchOptions(model_path=path, max_seq=512, kv_tokens=1000, slots=3))
    limits = _settings(given, None).limits
    assert (limits.kv_tokens, limits.slots, limits.kv_budget) == (1000, 3, 960)  # whole blocks of 64
    with pytest.raises(SystemExit, match="serve: --kv-tokens 100 holds less than one sequence of --max-seq 512"):
        resolved(LaunchOptions(model_path=path, max_seq=512, kv_tokens=100))
    # a context that is not a whole number of KV blocks: 16 full sequences still fit (160 positions take 3 blocks)
    odd = resolved(LaunchOptions(model_path=path, max_seq=160))
    assert odd.kv_tokens == 16 * 3 * 64 and _settings(odd, None).limits.kv_budget // 192 == 16
    with pytest.raises(SystemExit, match=r"--kv-tokens 160 holds less .* --max-seq 160: give at least 192 "):
        resolved(LaunchOptions(model_path=path, max_seq=160, kv_tokens=160))  # 2 blocks for a 3-block sequence
