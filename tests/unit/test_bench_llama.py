"""Llama checkpoints: picked from config.json, loaded stage by stage, and token for token what transformers computes.

The checkpoints are tiny random ``LlamaForCausalLM`` models that the tests write with ``transformers``'
own ``save_pretrained`` (real tensor names, real config.json spelling); nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from raycluster_cli.models import tensorfile
from raycluster_cli.models.decoder import (
    ModelConfig,
    Stage,
    checkpoint_architecture,
    config_from_checkpoint,
    full_model_stage,
    greedy_generate,
)
from raycluster_cli.placement.partition import even_partition
from tests.llama_checkpoint import GQA, VARIANT, write_llama


@pytest.fixture(scope="module")
def gqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("llama-gqa"), seed=1, **GQA)


@pytest.fixture(scope="module")
def variant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("llama-variant"), seed=2, **VARIANT)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama(tmp_path_factory.mktemp("llama-sharded"), seed=3, shard="30KB", **GQA)


def _prompts(cfg: ModelConfig, batch: int = 3, length: int = 6, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, cfg.vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _transformers_greedy(path: Path, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding with transformers' own model, recomputing the whole sequence every step (no cache)."""
    model = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids, out = prompts, []
    with torch.no_grad():
        for _ in range(new_tokens):
            token = model(ids, use_cache=False).logits[:, -1].argmax(-1)
            out.append(token)
            ids = torch.cat([ids, token[:, None]], dim=1)
    return torch.stack(out, dim=1)


def test_config_json_picks_llama(gqa: Path, variant: Path) -> None:
    assert checkpoint_architecture(gqa) == "llama"
    cfg = config_from_checkpoint(gqa, max_seq=20, seed=1)
    assert (cfg.arch, cfg.vocab, cfg.d_model, cfg.heads, cfg.num_kv_heads, cfg.layers) == ("llama", 96, 48, 4, 2, 3)
    assert (cfg.mlp_width, cfg.dim_per_head, cfg.max_seq, cfg.tied_head) == (80, 12, 20, False)
    assert cfg.model_path == str(gqa) and ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    other = config_from_checkpoint(variant, max_seq=20)
    assert (other.dim_per_head, other.num_kv_heads, other.tied_head, other.attention_bias) == (16, 1, True, True)
    assert other.rope_type == "llama3" and other.rope_theta == 500000.0


def test_config_errors_name_the_problem(gqa: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exceed the model's 64 positions"):
        config_from_checkpoint(gqa, max_seq=65)
    with pytest.raises(ValueError, match=r"config\.json not found"):
        config_from_checkpoint(tmp_path, max_seq=8)
    raw = json.loads((gqa / "config.json").read_text())
    cases = [
        ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "'gemma'.*not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope scaling 'dynamic' is not supported"),
    ]
    for change, message in cases:
        (tmp_path / "config.json").write_text(json.dumps(raw | change))
        (tmp_path / "model.safetensors").write_bytes((gqa / "model.safetensors").read_bytes())
        with pytest.raises(ValueError, match=message):
            config_from_checkpoint(tmp_path, max_seq=8)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"neither model\.safetensors nor"):
        config_from_checkpoint(tmp_path, max_seq=8)


def test_older_config_spelling_gives_the_same_config(variant: Path, tmp_path: Path) -> None:
    """Checkpoints saved before transformers 5 spell RoPE as rope_theta + rope_scaling."""
    raw = json.loads((variant / "config.json").read_text())
    params = raw.pop("rope_parameters")
    old = raw | {"rope_theta": params.pop("rope_theta"), "rope_scaling": params}
    (tmp_path / "config.json").write_text(json.dumps(old))
    (tmp_path / "model.safetensors").symlink_to(variant / "model.safetensors")
    ours, theirs = config_from_checkpoint(tmp_path, 20), config_from_checkpoint(variant, 20)
    assert ours == ModelConfig.from_dict(theirs.to_dict() | {"model_path": str(tmp_path)})


@pytest.mark.parametrize("which", ["gqa", "variant", "sharded"])
def test_same_logits_and_tokens_as_transformers(which: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(which)
    cfg = config_from_checkpoint(path, max_seq=24)
    prompts = _prompts(cfg)
    model = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(prompts, use_cache=False).logits
    torch.testing.assert_close(full_model_stage(cfg, emit="logits")(prompts, "x", 0), theirs, rtol=1e-4, atol=1e-4)
    ours = greedy_generate([full_model_stage(cfg)], prompts, 12)
    assert torch.equal(ours, _transformers_greedy(path, prompts, 12))
    assert len(set(ours.flatten().tolist())) > 3  # not a degenerate model that repeats one token


def test_bf16_checkpoint_loads_as_float32(tmp_path: Path) -> None:
    path = write_llama(tmp_path, seed=4, dtype=torch.bfloat16, **GQA)
    header = tensorfile.read_header(path / "model.safetensors")
    assert {entry["dtype"] for entry in header.values()} == {"BF16"}
    cfg = config_from_checkpoint(path, max_seq=20)
    prompts = _prompts(cfg)
    assert torch.equal(greedy_generate([full_model_stage(cfg)], prompts, 8), _transformers_greedy(path, prompts, 8))


@pytest.mark.parametrize("ranges", [even_partition(3, 3), [(0, 2), (2, 5)], [(0, 1), (1, 4), (4, 5)]], ids=str)
@pytest.mark.parametrize("which", ["gqa", "variant"])
def test_sharded_across_stages_equals_unsharded(
    which: str, ranges: list[tuple[int, int]], request: pytest.FixtureRequest
) -> None:
    cfg = config_from_checkpoint(request.getfixturevalue(which), max_seq=24)
    prompts = _prompts(cfg)
    whole = full_model_stage(cfg, emit="logits")(prompts, "x", 0)
    stages = [Stage(cfg, a, b) for a, b in ranges]
    x = prompts
    for stage in stages[:-1]:
        x = stage(x, "x", 0)
    stages[-1].emit = "logits"
    torch.testing.assert_close(stages[-1](x, "x", 0), whole, rtol=0, atol=0)
    stages[-1].emit = "tokens"
    ref = greedy_generate([full_model_stage(cfg)], prompts, 12)
    assert torch.equal(greedy_generate(stages, prompts, 12), ref)
    assert torch.equal(greedy_generate(stages, prompts, 12, prefill_chunk=4), ref)


@pytest.mark.parametrize("which", ["gqa", "variant"])
def test_kv_cache_decode_equals_full_recompute(which: str, request: pytest.FixtureRequest) -> None:
    """Each decode step through the cache gives the logits of recomputing the whole sequence from scratch."""
    cfg = config_from_checkpoint(request.getfixturevalue(which), max_seq=24)
    cached, fresh = full_model_stage(cfg, emit="logits"), full_model_stage(cfg, emit="logits")
    ids = _prompts(cfg)
    logits = cached(ids, "c", 0)[:, -1]
    for step in range(10):
        torch.testing.assert_close(logits, fresh(ids, f"r{step}", 0)[:, -1], rtol=1e-5, atol=1e-5)
        token = logits.argmax(-1)[:, None]
        logits = cached(token, "c", ids.shape[1])[:, -1]
        ids = torch.cat([ids, token], dim=1)
    assert cached.cached_ids() == ["c"]


def _record_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str]]]:
    """Every (file, tensor names) the loader reads."""
    reads: list[tuple[str, list[str]]] = []
    real = tensorfile.load_tensors

    def recording(path: str | Path, names: Any) -> dict[str, torch.Tensor]:
        reads.append((Path(path).name, list(names)))
        return real(path, reads[-1][1])

    monkeypatch.setattr(tensorfile, "load_tensors", recording)
    return reads


def test_each_stage_reads_only_its_own_tensors(gqa: Path, variant: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = _record_reads(monkeypatch)
    cfg = config_from_checkpoint(gqa, max_seq=16)
    Stage(cfg, 2, 3)  # block 1 only
    names = [name for _, batch in reads for name in batch]
    assert len(names) == 9 and all(name.startswith("model.layers.1.") for name in names)
    reads.clear()
    Stage(cfg, cfg.head_unit, cfg.num_units)
    assert sorted(name for _, batch in reads for name in batch) == ["lm_head.weight", "model.norm.weight"]
    reads.clear()
    Stage(cfg, 0, 1)
    assert [batch for _, batch in reads] == [["model.embed_tokens.weight"]]
    reads.clear()
    tied = config_from_checkpoint(variant, max_seq=16)
    Stage(tied, tied.head_unit, tied.num_units)  # tied head: the embedding, no lm_head.weight
    assert sorted(name for _, batch in reads for name in batch) == ["model.embed_tokens.weight", "model.norm.weight"]


def test_sharded_checkpoint_stage_opens_only_the_shards_it_needs(
    sharded: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = json.loads((sharded / tensorfile.INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) >= 3  # really split into several files
    reads = _record_reads(monkeypatch)
    cfg = config_from_checkpoint(sharded, max_seq=16)
    Stage(cfg, 3, 4)  # block 2 only
    wanted = {file for name, file in index.items() if name.startswith("model.layers.2.")}
    assert {file for file, _ in reads} == wanted and len(wanted) < len(set(index.values()))
    assert all(name.startswith("model.layers.2.") for _, batch in reads for name in batch)


def test_checkpoint_that_does_not_fit_the_config_names_the_tensor(gqa: Path, variant: Path, tmp_path: Path) -> None:
    raw = json.loads((gqa / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"intermediate_size": 81}))
    (tmp_path / "model.safetensors").symlink_to(gqa / "model.safetensors")
    cfg = config_from_checkpoint(tmp_path, max_seq=16)
    with pytest.raises(tensorfile.TensorFileError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):
        Stage(cfg, 1, 2)
    untied = tmp_path / "untied"
    untied.mkdir()
    raw = json.loads((variant / "config.json").read_text())
    (untied / "config.json").write_text(json.dumps(raw | {"tie_word_embeddings": False}))
    (untied / "model.safetensors").symlink_to(variant / "model.safetensors")
    cfg = config_from_checkpoint(untied, max_seq=16)
    with pytest.raises(tensorfile.TensorFileError, match=r"no tensor named 'lm_head\.weight'"):
        Stage(cfg, cfg.head_unit, cfg.num_units)
