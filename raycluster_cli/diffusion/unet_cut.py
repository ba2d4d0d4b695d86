"""A UNet cut by blocks: diffusers' own ``UNet2DConditionModel`` submodules held in contiguous stages on several nodes.

When the UNet alone fits no node, ``bench`` (``unet_place``) cuts it into stages of whole units, in the order its
forward runs them: ``in`` (``conv_in`` with the timestep embedding, ``time_proj`` and ``time_embedding``), each of
``down_blocks``, ``mid_block``, each of ``up_blocks``, ``out`` (``conv_norm_out``, ``conv_act``, ``conv_out``).
``UNetStage`` holds a range of units and runs them as ``UNet2DConditionModel.forward`` does (diffusers 0.42): the
same calls of the same modules in the same order, so the cut's noise prediction is the library's own.  What crosses
a cut is the ``Carry``: the sample, the down blocks' residuals not yet consumed by the up blocks (the skip
activations, the bulk of the bytes in the middle of the UNet), the timestep embedding made once in the first stage,
and whether the up blocks get their output size; the text conditioning (the prompt's embeddings) is handed to every
stage with each call.

A stage loads only its own weights: the model is built on PyTorch's ``meta`` device (shapes, no storage), the held
modules are given storage and filled from the safetensors file key by key.  The same meta model, run on meta
tensors, gives the bytes that cross each cut for a request's shape without computing anything (``crossing_bytes``).
Only what Stable Diffusion's pipeline uses is cut; a UNet with class or added embeddings, an encoder projection or
adapters is refused with its name (``check_supported``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# the top-level modules of each end unit; the blocks are units of their own
IN_MODULES = ("conv_in", "time_proj", "time_embedding")
OUT_MODULES = ("conv_norm_out", "conv_act", "conv_out")
_UNSUPPORTED = {
    "class_embed_type": "class embeddings",
    "addition_embed_type": "added embeddings",
    "encoder_hid_dim": "an encoder projection",
    "encoder_hid_dim_type": "an encoder projection",
    "time_cond_proj_dim": "timestep conditioning",
    "attention_type": None,  # only "default" is cut (gated attention needs GLIGEN inputs)
}


def load_config(path: str | Path) -> dict[str, Any]:
    return dict(json.loads((Path(path) / "unet" / "config.json").read_text()))


def check_supported(config: dict[str, Any]) -> None:
    for key, what in _UNSUPPORTED.items():
        value = config.get(key)
        if key == "attention_type":
            if value not in (None, "default"):
                raise ValueError(f"the UNet's attention_type is {value!r}: only 'default' is cut by blocks")
        elif value is not None:
            raise ValueError(f"the UNet has {what} ({key}={value!r}): only Stable Diffusion's UNet is cut by blocks")


def unit_names(config: dict[str, Any]) -> list[str]:
    """The units in the order the forward runs them: in, down_blocks.i …, mid_block, up_blocks.i …, out."""
    downs = [f"down_blocks.{i}" for i in range(len(config["down_block_types"]))]
    ups = [f"up_blocks.{i}" for i in range(len(config["up_block_types"]))]
    mid = ["mid_block"] if config.get("mid_block_type", "UNetMidBlock2DCrossAttn") is not None else []
    return ["in", *downs, *mid, *ups, "out"]


def _unit_of(key: str) -> str:
    top = key.split(".", 1)[0]
    if top in IN_MODULES:
        return "in"
    if top in OUT_MODULES:
        return "out"
    if top in ("down_blocks", "up_blocks"):
        return ".".join(key.split(".", 2)[:2])
    return top


def weight_file(path: str | Path) -> Path:
    folder = Path(path) / "unet"
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"the block cut reads one safetensors file in {folder}, found {len(files)}")
    return files[0]


def unit_bytes(path: str | Path, bytes_per_value: int = 4) -> dict[str, int]:
    """Each unit's weights in memory, from the safetensors header (nothing read but the header)."""
    from raycluster_cli.models.tensorfile import read_header

    names = unit_names(load_config(path))
    sizes = dict.fromkeys(names, 0)
    header = read_header(weight_file(path))
    for key, tensor in header.items():
        unit = _unit_of(key)
        if unit not in sizes:
            raise ValueError(f"the UNet weight {key} belongs to no unit the block cut knows ({', '.join(names)})")
        sizes[unit] += math.prod(tensor["shape"]) * bytes_per_value
    return sizes


def _meta_model(config: dict[str, Any]) -> Any:
    from diffusers import UNet2DConditionModel

    check_supported(config)
    with torch.device("meta"):
        return UNet2DConditionModel.from_config(config).eval()


@dataclass
class Carry:
    """What one stage hands the next within a UNet call."""

    sample: torch.Tensor
    emb: torch.Tensor
    residuals: tuple[torch.Tensor, ...] = ()
    forward_upsample_size: bool = False

    def nbytes(self) -> int:
        tensors = [self.sample, self.emb, *self.residuals]
        return sum(t.numel() * t.element_size() for t in tensors)


class UNetStage:
    """Units ``[start, end)`` of a checkpoint's UNet, only their weights in memory, run as the library's forward."""

    def __init__(self, path: str | Path, start: int, end: int, dtype: torch.dtype = torch.float32) -> None:
        self.config = load_config(path)
        self.names = unit_names(self.config)
        if not 0 <= start < end <= len(self.names):
            raise ValueError(f"units [{start}, {end}) are not a range of the UNet's {len(self.names)} units")
        self.start, self.end, self.dtype = start, end, dtype
        self.model = _meta_model(self.config)
        self.held = self.names[start:end]
        self._load(path)

    @classmethod
    def on_meta(cls, path: str | Path, start: int, end: int) -> UNetStage:
        """A stage with no storage, for shapes (``crossing_bytes``)."""
        stage = cls.__new__(cls)
        stage.config = load_config(path)
        stage.names = unit_names(stage.config)
        stage.start, stage.end, stage.dtype = start, end, torch.float32
        stage.model = _meta_model(stage.config)
        stage.held = stage.names[start:end]
        return stage

    def modules(self, unit: str) -> list[tuple[str, Any]]:
        if unit == "in":
            names: tuple[str, ...] = IN_MODULES
        elif unit == "out":
            names = OUT_MODULES
        else:
            names = (unit,)
        return [(name, self.model.get_submodule(name)) for name in names]

    def _load(self, path: str | Path) -> None:
        from safetensors import safe_open

        with safe_open(str(weight_file(path)), framework="pt") as f:
            keys = list(f.keys())
            for unit in self.held:
                for name, module in self.modules(unit):
                    module.to_empty(device="cpu")
                    prefix = name + "."
                    state = {k[len(prefix) :]: f.get_tensor(k).to(self.dtype) for k in keys if k.startswith(prefix)}
                    module.load_state_dict(state, strict=True)
                    module.to(self.dtype)

    def weight_bytes(self) -> int:
        return sum(
            p.numel() * p.element_size()
            for unit in self.held
            for _, m in self.modules(unit)
            for p in m.parameters()
            if p.device.type != "meta"
        )

    def begin(self, sample: torch.Tensor, timestep: Any) -> Carry:
        """The ``in`` unit: the timestep embedding and ``conv_in`` (forward's lines before the down blocks)."""
        model = self.model
        upsample = any(dim % (2**model.num_upsamplers) != 0 for dim in sample.shape[-2:])
        if self.config.get("center_input_sample"):
            sample = 2 * sample - 1.0
        t_emb = model.get_time_embed(sample=sample, timestep=timestep)
        emb = model.time_embedding(t_emb, None)
        if model.time_embed_act is not None:
            emb = model.time_embed_act(emb)
        sample = model.conv_in(sample)
        return Carry(sample, emb, (sample,), upsample)

    def _down(self, block: Any, carry: Carry, context: torch.Tensor) -> None:
        if getattr(block, "has_cross_attention", False):
            carry.sample, res = block(hidden_states=carry.sample, temb=carry.emb, encoder_hidden_states=context)
        else:
            carry.sample, res = block(hidden_states=carry.sample, temb=carry.emb)
        carry.residuals += res

    def _mid(self, block: Any, carry: Carry, context: torch.Tensor) -> None:
        if getattr(block, "has_cross_attention", False):
            carry.sample = block(carry.sample, carry.emb, encoder_hidden_states=context)
        else:
            carry.sample = block(carry.sample, carry.emb)

    def _up(self, index: int, block: Any, carry: Carry, context: torch.Tensor) -> None:
        is_final = index == len(self.model.up_blocks) - 1
        res = carry.residuals[-len(block.resnets) :]
        carry.residuals = carry.residuals[: -len(block.resnets)]
        size = carry.residuals[-1].shape[2:] if not is_final and carry.forward_upsample_size else None
        kwargs: dict[str, Any] = (
            {"encoder_hidden_states": context} if getattr(block, "has_cross_attention", False) else {}
        )
        carry.sample = block(
            hidden_states=carry.sample, temb=carry.emb, res_hidden_states_tuple=res, upsample_size=size, **kwargs
        )

    def finish(self, carry: Carry) -> torch.Tensor:
        """The ``out`` unit: the noise prediction."""
        sample = carry.sample
        if self.model.conv_norm_out is not None:
            sample = self.model.conv_act(self.model.conv_norm_out(sample))
        out: torch.Tensor = self.model.conv_out(sample)
        return out

    @torch.no_grad()
    def forward(self, x: torch.Tensor | Carry, timestep: Any, context: torch.Tensor) -> torch.Tensor | Carry:
        """The held units on ``x`` (the scaled latents when this stage holds ``in``, else the previous stage's
        carry); the noise prediction when it holds ``out``, else the carry for the next stage."""
        context = self.model.process_encoder_hidden_states(encoder_hidden_states=context, added_cond_kwargs=None)
        if self.start == 0:
            carry = self.begin(x, timestep)  # type: ignore[arg-type]
        else:
            assert isinstance(x, Carry), "a stage after the first needs the previous stage's carry"
            carry = dataclasses.replace(x)  # the caller's carry is left as it was (a probe runs it again)
        for unit in self.held:
            kind, _, index = unit.partition(".")
            if kind == "down_blocks":
                self._down(self.model.down_blocks[int(index)], carry, context)
            elif kind == "mid_block":
                self._mid(self.model.mid_block, carry, context)
            elif kind == "up_blocks":
                self._up(int(index), self.model.up_blocks[int(index)], carry, context)
        return self.finish(carry) if self.end == len(self.names) else carry


def crossing_bytes(path: str | Path, batch: int, height: int, width: int, tokens: int, dim: int) -> list[int]:
    """The carry's bytes across each cut (after unit 0, 1, …) for one UNet call of ``batch`` latents of
    ``height`` × ``width`` (float32), computed on meta tensors: shapes only, no weights, no arithmetic."""
    config = load_config(path)
    stage = UNetStage.on_meta(path, 0, len(unit_names(config)))
    sample = torch.empty(batch, config["in_channels"], height, width, device="meta")
    context = torch.empty(batch, tokens, dim, device="meta")
    carry = stage.begin(sample, torch.tensor(1))
    out = [carry.nbytes()]
    for unit in stage.held[1:-1]:
        kind, _, index = unit.partition(".")
        if kind == "down_blocks":
            stage._down(stage.model.down_blocks[int(index)], carry, context)
        elif kind == "mid_block":
            stage._mid(stage.model.mid_block, carry, context)
        else:
            stage._up(int(index), stage.model.up_blocks[int(index)], carry, context)
        out.append(carry.nbytes())
    return out
