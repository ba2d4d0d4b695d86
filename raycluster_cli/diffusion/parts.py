"""A diffusers checkpoint's parts, each loaded where it runs, and the three steps of a generation.

A Stable Diffusion–architecture checkpoint (``model_index.json`` with ``text_encoder``, ``tokenizer``, ``unet``,
``vae`` and ``scheduler``) is generated in three steps, each needing only its own part: the prompt through the
text encoder, the denoising loop through the UNet and the scheduler, the latents through the VAE's decoder.
``Components`` loads only the parts a node was given (with diffusers' and transformers' own loaders), so a node
that cannot hold the whole pipeline holds one step of it.  The steps follow ``StableDiffusionPipeline.__call__``
(diffusers 0.42): the same tokenisation, classifier-free guidance, initial noise from the request's seeded
generator, scheduler steps and decoding, so the image equals the library's own for the same prompt, seed and
steps (tests/unit/test_bench_diffusion.py).  The safety checker is not run (a checkpoint's own is ignored).
``reference_step`` is the library's own pipeline run one part at a time (what the image is checked against).
"""

from __future__ import annotations

import inspect
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

PARTS = ("text", "unet", "vae")  # the steps, in order; a replica holds all three or one node each
_SUBFOLDERS = {"text": ("text_encoder", "tokenizer"), "unet": ("unet", "scheduler"), "vae": ("vae",)}


@dataclass(frozen=True)
class ImageRequest:
    prompt: str
    seed: int
    steps: int = 20
    height: int = 512
    width: int = 512
    guidance: float = 7.5
    negative_prompt: str = ""
    n: int = 1  # images for this prompt, one batch (as diffusers' num_images_per_prompt)


def is_diffusers_folder(path: str | Path) -> bool:
    return (Path(path) / "model_index.json").is_file()


def part_bytes(path: str | Path, bytes_per_value: int = 4) -> dict[str, int]:
    """Each step's weights in memory at ``bytes_per_value`` (float32: 4), counted from the safetensors headers
    (no weight is read); a part stored only as ``.bin`` is counted by its file size."""
    from raycluster_cli.models.tensorfile import read_header

    root = Path(path)
    sizes: dict[str, int] = {}
    for part, folders in _SUBFOLDERS.items():
        total = 0
        for folder in folders:
            for f in sorted((root / folder).glob("*")):
                if f.suffix == ".safetensors":
                    header = read_header(f)
                    total += sum(math.prod(t["shape"]) * bytes_per_value for t in header.values())
                elif f.suffix == ".bin":
                    total += f.stat().st_size
        sizes[part] = total
    return sizes


def vae_scale_factor(path: str | Path) -> int:
    config = json.loads((Path(path) / "vae" / "config.json").read_text())
    return int(2 ** (len(config.get("block_out_channels", [0])) - 1))


def _scheduler_class(path: Path) -> Any:
    """The scheduler class ``model_index.json`` names, which must be one of diffusers' schedulers (a subclass of
    its ``SchedulerMixin``): the folder chooses a class by name, so a name for anything else in the library (a
    pipeline, a loader, a module) is refused, in one line naming the file and field."""
    import diffusers

    index_file = path / "model_index.json"
    entry = json.loads(index_file.read_text()).get("scheduler")
    library, name = entry if isinstance(entry, list) and len(entry) == 2 else (None, entry)
    found = getattr(diffusers, name, None) if library == "diffusers" and isinstance(name, str) else None
    if not (isinstance(found, type) and issubclass(found, diffusers.SchedulerMixin)):
        raise ValueError(
            f'{index_file}: "scheduler" is {json.dumps(entry)}, not a diffusers scheduler: name one such as '
            '["diffusers", "DDIMScheduler"]'
        )
    return found


def check_scheduler(path: str | Path) -> None:
    """Refuse a folder whose ``model_index.json`` names no diffusers scheduler (``_scheduler_class``)."""
    _scheduler_class(Path(path))


class Components:
    """The parts of one checkpoint that this process holds, and the steps they can run."""

    def __init__(self, path: str | Path, parts: tuple[str, ...] = PARTS, dtype: torch.dtype = torch.float32) -> None:
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}: the parts are {list(PARTS)}")
        self.path, self.parts, self.dtype = Path(path), tuple(parts), dtype
        self.scale_factor = vae_scale_factor(self.path)
        self.text_encoder: Any = None
        self.tokenizer: Any = None
        self.unet: Any = None
        self.scheduler: Any = None
        self.vae: Any = None
        started = time.monotonic()
        if "text" in parts:
            from transformers import AutoTokenizer, CLIPTextModel

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.path / "tokenizer"))
            self.text_encoder = CLIPTextModel.from_pretrained(str(self.path / "text_encoder"), dtype=dtype).eval()
        if "unet" in parts:
            from diffusers import UNet2DConditionModel

            self.unet = UNet2DConditionModel.from_pretrained(str(self.path / "unet"), torch_dtype=dtype).eval()
            self.scheduler = _scheduler_class(self.path).from_pretrained(str(self.path / "scheduler"))
        if "vae" in parts:
            from diffusers import AutoencoderKL
            from diffusers.image_processor import VaeImageProcessor

            self.vae = AutoencoderKL.from_pretrained(str(self.path / "vae"), torch_dtype=dtype).eval()
            self.processor = VaeImageProcessor(vae_scale_factor=self.scale_factor)
        self.load_s = time.monotonic() - started

    def weight_bytes(self) -> int:
        models = [self.text_encoder, self.unet, self.vae]
        return sum(p.numel() * p.element_size() for m in models if m is not None for p in m.parameters())

    @torch.no_grad()
    def encode(self, request: ImageRequest) -> torch.Tensor:
        """The prompt's embeddings (the negative prompt's first when guidance is on), one row per image."""

        def embed(texts: list[str]) -> torch.Tensor:
            ids = self.tokenizer(
                texts, padding="max_length", max_length=self.tokenizer.model_max_length, truncation=True,
                return_tensors="pt",
            ).input_ids  # fmt: skip
            return self.text_encoder(ids)[0].to(self.dtype)

        prompt = embed([request.prompt]).repeat_interleave(request.n, dim=0)
        if request.guidance <= 1.0:
            return prompt
        negative = embed([request.negative_prompt]).repeat_interleave(request.n, dim=0)
        return torch.cat([negative, prompt])

    @torch.no_grad()
    def denoise(self, embeddings: torch.Tensor, request: ImageRequest) -> torch.Tensor:
        """The denoising loop: initial noise from the request's seed, the UNet and the scheduler for each step."""
        from diffusers.utils.torch_utils import randn_tensor

        generator = torch.Generator().manual_seed(request.seed)
        channels = self.unet.config.in_channels
        shape = (request.n, channels, request.height // self.scale_factor, request.width // self.scale_factor)
        self.scheduler.set_timesteps(request.steps)
        latents = randn_tensor(shape, generator=generator, dtype=self.dtype) * self.scheduler.init_noise_sigma
        accepted = set(inspect.signature(self.scheduler.step).parameters)
        extra = {k: v for k, v in (("eta", 0.0), ("generator", generator)) if k in accepted}
        guided = request.guidance > 1.0
        embeddings = embeddings.to(self.dtype)
        for t in self.scheduler.timesteps:
            model_input = torch.cat([latents] * 2) if guided else latents
            model_input = self.scheduler.scale_model_input(model_input, t)
            noise = self.unet(model_input, t, encoder_hidden_states=embeddings, return_dict=False)[0]
            if guided:
                uncond, text = noise.chunk(2)
                noise = uncond + request.guidance * (text - uncond)
            latents = self.scheduler.step(noise, t, latents, **extra, return_dict=False)[0]
        return latents

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """The images as float arrays in [0, 1], shape (n, height, width, 3), as diffusers' ``output_type="np"``."""
        image = self.vae.decode(latents.to(self.dtype) / self.vae.config.scaling_factor, return_dict=False)[0]
        out: np.ndarray = self.processor.postprocess(image, output_type="np", do_denormalize=[True] * image.shape[0])
        return out

    def generate(self, request: ImageRequest) -> np.ndarray:
        """All three steps here (a node that holds the whole pipeline)."""
        return self.decode(self.denoise(self.encode(request), request))


def reference_step(path: str | Path, part: str, request: ImageRequest, given: Any) -> Any:
    """One step of diffusers' own ``StableDiffusionPipeline`` for ``request``, loading only ``part``: ``text``
    gives (prompt embeddings, negative embeddings) by ``encode_prompt``; ``unet`` takes them (``given``) through
    the pipeline's own ``__call__`` to latents (``output_type="latent"``); ``vae`` decodes ``given`` latents and
    post-processes them as ``__call__`` does (``output_type="np"``).  The three in a row give the library's image
    (tests/unit/test_bench_diffusion.py) with one part in memory at a time."""
    from diffusers import StableDiffusionPipeline

    absent = {"text": ("text_encoder", "tokenizer"), "unet": ("unet",), "vae": ("vae",)}
    skip = {name: None for other, names in absent.items() if other != part for name in names}
    pipe = StableDiffusionPipeline.from_pretrained(
        str(path), safety_checker=None, requires_safety_checker=False, dtype=torch.float32, **skip
    )
    pipe.set_progress_bar_config(disable=True)
    guided = request.guidance > 1.0
    if part == "text":
        negative = request.negative_prompt or None
        return pipe.encode_prompt(request.prompt, "cpu", request.n, guided, negative)
    if part == "unet":
        pipe.vae_scale_factor = vae_scale_factor(path)  # the pipeline's default (8) when it has no VAE
        prompt, negative = given
        return pipe(
            prompt_embeds=prompt, negative_prompt_embeds=negative, num_inference_steps=request.steps,
            generator=torch.Generator().manual_seed(request.seed), output_type="latent", height=request.height,
            width=request.width, guidance_scale=request.guidance,
        ).images  # fmt: skip
    with torch.no_grad():
        image = pipe.vae.decode(given / pipe.vae.config.scaling_factor, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="np", do_denormalize=[True] * image.shape[0])
