"""Qwen2, Mistral and Phi-3 checkpoints: token for token what transformers' own models of each compute.

All are Llama's blocks with other settings: Qwen2 has q/k/v biases and no output bias (tied or untied
head), Mistral a sliding window, Phi-3 fused q/k/v and gate/up tensors (split at load), a sliding window
and RoPE on only part of each head.  The checkpoints are tiny random models written by ``transformers``'
``save_pretrained``; the comparison runs unsharded, split into stages, and through serve's batched stage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from raycluster_cli.models.batched import BatchedStage
from raycluster_cli.models.decoder import Stage, config_from_checkpoint, full_model_stage, greedy_generate
from raycluster_cli.placement.partition import even_partition
from tests.llama_checkpoint import GQA, model_class, write_llama

# name -> (family, settings); windows shorter than the 20-token sequences below are applied, not dropped
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("qwen2", GQA),
    "qwen2-tied": ("qwen2", {"num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True}),
    "qwen2-window": (
        "qwen2",
        GQA | {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    ),
    "mistral": ("mistral", GQA | {"sliding_window": None}),
    "mistral-window": ("mistral", GQA | {"sliding_window": 4}),
    "mistral-long-window": ("mistral", GQA | {"sliding_window": 4096}),
    "phi3": ("phi3", GQA | {"sliding_window": None}),
    # fused q/k/v and gate/up split at load, half of each head rotated, a window that hides keys, tied head
    "phi3-partial-window": (
        "phi3",
        {"num_attention_heads": 4, "num_key_value_heads": 1, "tie_word_embeddings": True}
        | {"partial_rotary_factor": 0.5, "sliding_window": 5},
    ),
}
PROMPT, NEW = 8, 12


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    family, settings = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return family, write_llama(path, seed=7, family=family, **settings)


def _prompts(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (3, PROMPT), generator=torch.Generator().manual_seed(11))


def _theirs(family: str, path: Path, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits of the prompts and its greedy tokens, recomputing the whole sequence each step."""
    model = model_class(family).from_pretrained(str(path), dtype=torch.float32).eval()
    ids, out = prompts, []
    with torch.no_grad():
        logits = model(prompts, use_cache=False).logits
        for _ in range(NEW):
            token = model(ids, use_cache=False).logits[:, -1].argmax(-1)
            out.append(token)
            ids = torch.cat([ids, token[:, None]], dim=1)
    return logits, torch.stack(out, dim=1)


def test_config_reads_the_family(checkpoint: tuple[str, Path]) -> None:
    family, path = checkpoint
    raw = json.loads((path / "config.json").read_text())
    cfg = config_from_checkpoint(path, max_seq=PROMPT + NEW)
    assert (cfg.arch, cfg.family, cfg.qkv_bias, cfg.attention_bias) == ("llama", family, family == "qwen2", False)
    assert cfg.tied_head == bool(raw.get("tie_word_embeddings"))
    window = raw.get("sliding_window") if family in ("mistral", "phi3") or raw.get("use_sliding_window") else None
    assert cfg.sliding_window == (window if window and window < PROMPT + NEW else 0)
    assert cfg.window_from_layer == (1 if cfg.sliding_window and family == "qwen2" else 0)
    assert cfg.rotary_width == (cfg.dim_per_head // 2 if "partial" in path.name else cfg.dim_per_head)


def test_same_tokens_as_transformers(checkpoint: tuple[str, Path]) -> None:
    family, path = checkpoint
    cfg = config_from_checkpoint(path, max_seq=PROMPT + NEW)
    prompts = _prompts(cfg.vocab)
    logits, tokens = _theirs(family, path, prompts)
    torch.testing.assert_close(full_model_stage(cfg, emit="logits")(prompts, "x", 0), logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(greedy_generate([full_model_stage(cfg)], prompts, NEW), tokens)
    stages = [Stage(cfg, a, b) for a, b in even_partition(cfg.layers, 2)]
    assert torch.equal(greedy_generate(stages, prompts, NEW, prefill_chunk=3), tokens)
    assert len(set(tokens.flatten().tolist())) > 3  # not a degenerate model that repeats one token


def test_batched_stage_same_tokens_as_transformers(checkpoint: tuple[str, Path]) -> None:
    """Serve's batched path: each row in its own slot, prompts of different lengths side by side."""
    family, path = checkpoint
    cfg = config_from_checkpoint(path, max_seq=PROMPT + NEW)
    prompts = _prompts(cfg.vocab)
    _, tokens = _theirs(family, path, prompts)
    half = 1 + cfg.layers // 2
    stages = [BatchedStage(cfg, 0, half, slots=3), BatchedStage(cfg, half, cfg.num_units, slots=3)]

    def step(slots: list[int], pieces: list[torch.Tensor], starts: list[int]) -> torch.Tensor:
        width = max(len(p) for p in pieces)
        x = torch.stack([torch.cat([p, p.new_zeros(width - len(p))]) for p in pieces])
        table = torch.tensor([slots, starts, [len(p) for p in pieces]], dtype=torch.long)
        for stage in stages:
            x = stage.forward(x, table)
        return x.argmax(-1)

    # row 0 prefills at once beside the first pieces of rows 1 and 2 (padded), then rows 1 and 2 finish
    first = step([0, 1, 2], [prompts[0], prompts[1, :3], prompts[2, :5]], [0, 0, 0])
    rest = step([1, 2], [prompts[1, 3:], prompts[2, 5:]], [3, 5])
    got = [torch.stack([first[0], rest[0], rest[1]])]
    for i in range(NEW - 1):  # all three decode side by side
        got.append(step([0, 1, 2], [t[None] for t in got[-1]], [PROMPT + i] * 3))
    assert torch.equal(torch.stack(got, dim=1), tokens)


def test_unknown_family_and_odd_layer_types_are_refused(tmp_path: Path) -> None:
    path = write_llama(tmp_path / "qwen2", family="qwen2", **GQA)
    raw = json.loads((path / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(raw | {"model_type": "gemma", "architectures": []}))
    with pytest.raises(ValueError, match=r"'gemma'.*not supported.*Mistral \(mistral\) or Phi-3 \(phi3\)"):
        config_from_checkpoint(tmp_path, max_seq=8)
    odd = ["sliding_attention", "full_attention", "sliding_attention"]
    change = {"use_sliding_window": True, "sliding_window": 2, "layer_types": odd}
    (tmp_path / "config.json").write_text(json.dumps(raw | change))
    with pytest.raises(ValueError, match="layer_types"):
        config_from_checkpoint(tmp_path, max_seq=8)


def test_phi3_long_context_rope_is_refused_naming_rope_scaling(tmp_path: Path) -> None:
    """Phi-3's longrope (also spelled su or yarn in older configs) switches tables with the sequence length:
    refused with one line, not run with the wrong rotations."""
    path = write_llama(tmp_path / "phi3", family="phi3", **GQA)
    raw = json.loads((path / "config.json").read_text())
    half = raw["hidden_size"] // raw["num_attention_heads"] // 2
    for kind in ("longrope", "su"):
        scaling = {"type": kind, "short_factor": [1.0] * half, "long_factor": [2.0] * half}
        (path / "config.json").write_text(json.dumps(raw | {"rope_parameters": None, "rope_scaling": scaling}))
        with pytest.raises(ValueError, match=rf"config.json: rope_scaling '{kind}' .*not supported.*no rope_scaling"):
            config_from_checkpoint(path, max_seq=8)


def test_bf16_phi3_checkpoint_loads_as_float32(tmp_path: Path) -> None:
    """The fused tensors of a bfloat16 checkpoint are split and widened as transformers widens them."""
    path = write_llama(tmp_path, seed=7, family="phi3", dtype=torch.bfloat16, partial_rotary_factor=0.5, **GQA)
    cfg = config_from_checkpoint(path, max_seq=PROMPT + NEW)
    prompts = _prompts(cfg.vocab)
    _, tokens = _theirs("phi3", path, prompts)
    stages = [Stage(cfg, a, b) for a, b in even_partition(cfg.layers, 2)]
    assert torch.equal(greedy_generate(stages, prompts, NEW), tokens)
