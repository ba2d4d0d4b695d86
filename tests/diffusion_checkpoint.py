"""A tiny random Stable Diffusion–architecture checkpoint, written with diffusers and transformers (no download).

The parts are the real classes a Stable Diffusion checkpoint has (CLIPTextModel + CLIPTokenizer, a cross-attention
UNet2DConditionModel, AutoencoderKL, a DDIM scheduler), a few thousand parameters each, saved with
``StableDiffusionPipeline.save_pretrained`` in the Hugging Face layout (``model_index.json`` and one folder a part).
``width`` scales the UNet's channels: a wider UNet makes a generation slower (for balance tests) and the
checkpoint bigger (for memory tests).  ``text_vocab`` and ``time_dim`` make the text encoder and the UNet hundreds
of MB while their compute stays that of the tiny model: the first pads the text encoder's token embedding table
(the tokenizer's ids use its first rows), the second widens the UNet's time embedding (one matrix-vector product
per call), for runs on containers whose memory limit is below the whole pipeline's; ``half`` stores it in float16.
"""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ["a", "cat", "dog", "red", "blue", "house", "tree", "on", "the", "hill", "small", "green"]


def write_tiny_sd(
    path: Path,
    width: int = 32,
    seed: int = 0,
    text_vocab: int | None = None,
    time_dim: int | None = None,
    half: bool = False,
) -> Path:
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    path.mkdir(parents=True, exist_ok=True)
    words = path.parent / f".{path.name}-tokenizer"
    words.mkdir(exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for word in WORDS:
        vocab[word + "</w>"] = len(vocab)
    for c in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    (words / "vocab.json").write_text(json.dumps(vocab))
    (words / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(words / "vocab.json"), str(words / "merges.txt"), model_max_length=16)
    torch.manual_seed(seed)
    text = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=max(len(vocab), text_vocab or 0), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=16, projection_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        )
    )  # fmt: skip
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(width, 2 * width),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8, time_embedding_dim=time_dim,
    )  # fmt: skip
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(16, 32), latent_channels=4,
        norm_num_groups=8, sample_size=16,
    )  # fmt: skip
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet, scheduler=scheduler, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )  # fmt: skip
    if half:  # stored in float16 (as many published checkpoints), loaded in float32: the weights are copies
        pipe.to(torch.float16)
    pipe.save_pretrained(path)
    return path


def diffusers_image(path: Path, prompt: str, seed: int, steps: int, size: int, guidance: float = 7.5):  # type: ignore[no-untyped-def]
    """What diffusers' own StableDiffusionPipeline makes: (n, size, size, 3) floats in [0, 1]."""
    import torch
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), output_type="np",
        height=size, width=size, guidance_scale=guidance,
    )  # fmt: skip
    return out.images
