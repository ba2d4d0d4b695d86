"""GPT-2 checkpoints: the safetensors reader, loading unit by unit, and GPT-2's own maths."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from raycluster_cli.models import gpt2
from raycluster_cli.models.decoder import Stage, full_model_stage, greedy_generate
from raycluster_cli.models.tensorfile import TensorFileError, load_tensors, read_header
from raycluster_cli.placement.partition import even_partition, manual_partition

from ..bench_checkpoints import save_tensors, write_random_gpt2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_gpt2(tmp_path_factory.mktemp("gpt2"), layers=3, d_model=64, heads=4, vocab=96, seed=7)


def test_safetensors_partial_read_and_bad_files(tmp_path: Path) -> None:
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1, -2], dtype=torch.int64),
        "c": torch.ones(4, dtype=torch.float16),
        "empty": torch.zeros(0, 5),
    }
    path = tmp_path / "t.safetensors"
    save_tensors(path, tensors, {"format": "pt"})
    table = read_header(path)
    assert table["a"] == {"dtype": "F32", "shape": [2, 3]} and table["empty"]["shape"] == [0, 5]
    assert set(table) == set(tensors)
    got = load_tensors(path, ["c", "a"])
    assert set(got) == {"c", "a"}
    assert torch.equal(got["a"], tensors["a"]) and got["c"].dtype == torch.float16
    assert torch.equal(load_tensors(path, ["b"])["b"], tensors["b"])
    assert load_tensors(path, ["empty"])["empty"].shape == (0, 5)
    with pytest.raises(TensorFileError, match="no tensor named 'zz'"):
        load_tensors(path, ["zz"])
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(TensorFileError, match=r"t\.safetensors: not a valid safetensors file"):
        load_tensors(path, ["a"])


def test_config_from_dir(tiny: Path, tmp_path: Path) -> None:
    cfg = gpt2.config_from_dir(tiny, max_seq=20, seed=1)
    assert (cfg.vocab, cfg.d_model, cfg.heads, cfg.layers, cfg.max_seq) == (96, 64, 4, 3, 20)
    assert cfg.activation == "gelu_new" and cfg.model_path == str(tiny)
    with pytest.raises(ValueError, match="exceed the model's 64 positions"):
        gpt2.config_from_dir(tiny, max_seq=65)
    with pytest.raises(ValueError, match=r"config\.json not found"):
        gpt2.config_from_dir(tmp_path, max_seq=8)
    other = tmp_path / "other"
    write_random_gpt2(other, layers=1)
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not gpt2"):
        gpt2.config_from_dir(other, max_seq=8)


def test_each_stage_reads_only_its_own_tensors(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = gpt2.config_from_dir(tiny, max_seq=16)
    asked: list[list[str]] = []
    real = gpt2.load_tensors
    monkeypatch.setattr(gpt2, "load_tensors", lambda path, names: asked.append(list(names)) or real(path, names))
    Stage(cfg, 2, 3)  # block 1 only, one tensor per read
    assert len(asked) == 12 and all(len(names) == 1 and names[0].startswith("h.1.") for names in asked)
    asked.clear()
    Stage(cfg, cfg.head_unit, cfg.num_units)
    assert sorted(n for names in asked for n in names) == ["ln_f.bias", "ln_f.weight", "wte.weight"]  # tied head
    asked.clear()
    Stage(cfg, 0, 1)
    assert sorted(n for names in asked for n in names) == ["wpe.weight", "wte.weight"]


def _reference_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """GPT-2 written out from its definition (Conv1D: x @ W + b, tanh GELU, tied head), no cache."""
    w = load_tensors(path / "model.safetensors", read_header(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    heads, layers = config["n_head"], config["n_layer"]
    steps = ids.shape[1]
    x = w["wte.weight"][ids] + w["wpe.weight"][:steps]
    d = x.shape[-1]

    def ln(v: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(v, (d,), w[f"{name}.weight"], w[f"{name}.bias"], eps=1e-5)

    def gelu_new(v: torch.Tensor) -> torch.Tensor:
        return 0.5 * v * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v**3)))

    causal = torch.tril(torch.ones(steps, steps, dtype=torch.bool))
    for i in range(layers):
        p = f"h.{i}."
        q, k, v = (ln(x, p + "ln_1") @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]).split(d, dim=-1)
        q, k, v = (t.view(*t.shape[:2], heads, d // heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // heads)
        att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        merged = att.transpose(1, 2).reshape(x.shape)
        x = x + merged @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        hidden = gelu_new(ln(x, p + "ln_2") @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + hidden @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ w["wte.weight"].T


def test_loaded_model_computes_gpt2(tiny: Path) -> None:
    cfg = gpt2.config_from_dir(tiny, max_seq=16)
    ids = torch.randint(0, cfg.vocab, (2, 7), generator=torch.Generator().manual_seed(3))
    ours = full_model_stage(cfg, emit="logits")(ids, "x", 0)
    torch.testing.assert_close(ours, _reference_logits(tiny, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ranges", [even_partition(3, 3), manual_partition([2, 1]), [(0, 1), (1, 4), (4, 5)]], ids=str)
def test_sharded_gpt2_greedy_equals_unsharded(tiny: Path, ranges: list[tuple[int, int]]) -> None:
    cfg = gpt2.config_from_dir(tiny, max_seq=20)
    prompts = torch.randint(0, cfg.vocab, (3, 6), generator=torch.Generator().manual_seed(5))
    ref = greedy_generate([full_model_stage(cfg)], prompts, 10)
    got = greedy_generate([Stage(cfg, a, b) for a, b in ranges], prompts, 10)
    assert torch.equal(got, ref)
    assert len(set(ref.flatten().tolist())) > 1  # not a degenerate model that repeats one token


def test_matches_transformers_when_installed(tiny: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = gpt2.config_from_dir(tiny, max_seq=16)
    ids = torch.randint(0, cfg.vocab, (2, 7), generator=torch.Generator().manual_seed(3))
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tiny)).eval()
    with torch.no_grad():
        theirs = model(ids).logits
    torch.testing.assert_close(full_model_stage(cfg, emit="logits")(ids, "x", 0), theirs, rtol=1e-4, atol=1e-4)
