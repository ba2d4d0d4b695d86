"""The launcher's flags and its one JSON line (what the operator-side ``raycluster serve`` reads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from raycluster_cli.placement.pipelines import NodeSpeed, plan_replicas
from raycluster_cli.serve.__main__ import _parser, _report, _settings
from raycluster_cli.serve.settings import ServeSettings


def test_old_flags_still_parse_and_new_ones_default_to_measured_placement() -> None:
    args = _parser().parse_args(["--model-path", "/m", "--stages", "2", "--split", "2,1", "--no-auth"])
    assert (args.stages, args.split, args.replicas, args.no_measure) == (2, "2,1", 0, False)
    args = _parser().parse_args(["--model-path", "/m", "--replicas", "1", "--no-measure", "--replace-period", "5"])
    assert (args.replicas, args.no_measure, args.replace_period) == (1, True, 5.0)
    assert (
        args.dtype == "auto" and _parser().parse_args(["--model-path", "/m", "--dtype", "bfloat16"]).dtype == "bfloat16"
    )
    with pytest.raises(SystemExit):
        _parser().parse_args(["--model-path", "/m", "--dtype", "fp8"])


def test_the_json_line_names_url_model_replicas_and_each_replica_s_split() -> None:
    speeds = [NodeSpeed(f"n{i}", f"10.0.0.{i}", (0.1, *([float(i)] * 4), 0.1)) for i in (1, 2, 3, 4)]
    plans = plan_replicas(speeds, stages=2)
    settings = ServeSettings(
        model_path="/models/tiny", plans=tuple(plans), speeds=tuple(speeds), stages=2, dtype="bfloat16"
    )
    line = json.loads(json.dumps(_report("http://10.0.0.1:8000/v1", settings, 4)))
    assert set(line) == {"url", "model", "replicas", "split", "pipelines", "nodes", "why", "dtype"}
    assert line["model"] == "tiny" and line["replicas"] == 2 and line["dtype"] == "bfloat16"
    assert line["split"] == [list(r) for r in plans[0].ranges]
    stage = line["pipelines"][0]["stages"][0]
    assert set(stage) == {"units", "blocks", "node_ip", "node_id", "stage_s"}
    assert sum(s["blocks"] for s in line["pipelines"][1]["stages"]) == 4
    assert "replica(s)" in line["why"] and line["nodes"][0]["block_s"] == 1.0


def test_the_service_re_splits_itself_unless_told_not_or_given_a_split() -> None:
    def period(*flags: str) -> float:
        return _settings(_parser().parse_args(["--model-path", "/m", "--no-auth", *flags]), None).rebalance_period_s

    assert period() == 20.0 and period("--rebalance-period", "5") == 5.0 and period("--rebalance-period", "0") == 0
    assert period("--stages", "2", "--split", "2,1") == 0.0  # the operator's split is kept as given
    steps = _settings(_parser().parse_args(["--model-path", "/m", "--steps-in-flight", "4"]), None).max_in_flight
    assert steps == 4 and _settings(_parser().parse_args(["--model-path", "/m"]), None).max_in_flight is None


def test_max_seq_defaults_to_the_checkpoints_positions_capped_and_a_longer_one_names_the_flag(tmp_path: Path) -> None:
    from raycluster_cli.models.decoder import config_from_checkpoint
    from raycluster_cli.serve.__main__ import default_max_seq

    from ..serve_checkpoint import write_chat_llama

    small = write_chat_llama(tmp_path / "small")  # 256 positions
    assert _parser().parse_args(["--model-path", "/m"]).max_seq == 0
    assert default_max_seq(str(small)) == 256
    assert config_from_checkpoint(small, max_seq=default_max_seq(str(small))).max_seq == 256  # serves by default
    with pytest.raises(ValueError, match="exceed the model's 256 positions: pass --max-seq 256"):
        config_from_checkpoint(small, max_seq=512)
    for name, raw in {"llama3": {"max_position_embeddings": 131072}, "gpt2": {"n_positions": 1024}}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
    assert default_max_seq(str(tmp_path / "llama3")) == 4096 and default_max_seq(str(tmp_path / "gpt2")) == 1024
