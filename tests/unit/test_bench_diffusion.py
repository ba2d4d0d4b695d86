"""The three steps of a generation, each part loaded alone, give diffusers' own StableDiffusionPipeline image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("diffusers")

from raycluster_cli.diffusion.parts import Components, ImageRequest, is_diffusers_folder, part_bytes, reference_step

from ..diffusion_checkpoint import diffusers_image, write_tiny_sd

# float32 on CPU: the same operations in the same order; what remains is the order of reductions in torch's
# kernels between a batch of one and the pipeline's own call, far below one 8-bit level (1/255 = 0.0039)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_sd(tmp_path_factory.mktemp("sd") / "tiny-sd")


@pytest.mark.parametrize("guidance", [7.5, 1.0])
def test_the_whole_pipeline_in_one_process_equals_diffusers(checkpoint: Path, guidance: float) -> None:
    request = ImageRequest("a red cat on the hill", seed=3, steps=4, height=16, width=16, guidance=guidance)
    ours = Components(checkpoint).generate(request)
    theirs = diffusers_image(checkpoint, request.prompt, seed=3, steps=4, size=16, guidance=guidance)
    assert ours.shape == theirs.shape == (1, 16, 16, 3)
    assert np.abs(ours - theirs).max() <= TOLERANCE
    assert theirs.std() > 0.01  # a random model still draws something: the comparison is not of two blank images


def test_each_part_alone_chained_equals_diffusers(checkpoint: Path) -> None:
    request = ImageRequest("a blue house", seed=11, steps=3, height=16, width=16)
    text, unet, vae = (Components(checkpoint, (part,)) for part in ("text", "unet", "vae"))
    assert text.unet is None and text.vae is None and unet.text_encoder is None and vae.unet is None
    image = vae.decode(unet.denoise(text.encode(request), request))
    theirs = diffusers_image(checkpoint, request.prompt, seed=11, steps=3, size=16)
    assert np.abs(image - theirs).max() <= TOLERANCE


@pytest.mark.parametrize("guidance", [7.5, 1.0])
def test_diffusers_own_pipeline_one_part_at_a_time_gives_its_whole_image(checkpoint: Path, guidance: float) -> None:
    """The check's reference (``reference_step``, one part loaded per step) is diffusers' whole-pipeline image,
    for several images of one prompt too; and it is what our parts make."""
    import torch
    from diffusers import StableDiffusionPipeline

    request = ImageRequest("a small tree", seed=5, steps=3, height=16, width=16, guidance=guidance, n=2)
    given = None
    for part in ("text", "unet", "vae"):
        given = reference_step(checkpoint, part, request, given)
    pipe = StableDiffusionPipeline.from_pretrained(str(checkpoint))
    pipe.set_progress_bar_config(disable=True)
    whole = pipe(
        request.prompt, num_inference_steps=3, generator=torch.Generator().manual_seed(5), output_type="np",
        height=16, width=16, guidance_scale=guidance, num_images_per_prompt=2,
    ).images  # fmt: skip
    assert given.shape == whole.shape == (2, 16, 16, 3)
    assert np.abs(given - whole).max() <= TOLERANCE and np.abs(given[0] - given[1]).max() > 0.01
    assert np.abs(Components(checkpoint).generate(request) - given).max() <= TOLERANCE


def test_another_seed_is_another_image(checkpoint: Path) -> None:
    whole = Components(checkpoint)
    one = whole.generate(ImageRequest("a dog", seed=1, steps=2, height=16, width=16))
    two = whole.generate(ImageRequest("a dog", seed=2, steps=2, height=16, width=16))
    assert np.abs(one - two).max() > 0.01


def test_the_checkpoint_is_recognised_and_weighed_by_part(checkpoint: Path, tmp_path: Path) -> None:
    assert is_diffusers_folder(checkpoint) and not is_diffusers_folder(tmp_path)
    sizes = part_bytes(checkpoint)
    whole = Components(checkpoint)
    assert set(sizes) == {"text", "unet", "vae"} and all(v > 0 for v in sizes.values())
    # the files hold the parameters (float32) and a small header each
    assert sum(sizes.values()) == pytest.approx(whole.weight_bytes(), rel=0.05)


def test_in_bfloat16_it_equals_diffusers_own_pipeline_in_bfloat16(checkpoint: Path) -> None:
    """`serve --dtype bfloat16` on an image model: the same image as diffusers' pipeline loaded in bfloat16."""
    import torch
    from diffusers import StableDiffusionPipeline

    request = ImageRequest("a red cat", seed=3, steps=4, height=16, width=16)
    ours = Components(checkpoint, dtype=torch.bfloat16).generate(request)
    pipe = StableDiffusionPipeline.from_pretrained(str(checkpoint), torch_dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe(
        request.prompt, num_inference_steps=4, generator=torch.Generator().manual_seed(3), output_type="np",
        height=16, width=16,
    ).images  # fmt: skip
    assert np.abs(ours - theirs).max() <= TOLERANCE
    assert np.abs(ours - diffusers_image(checkpoint, request.prompt, 3, 4, 16)).max() > TOLERANCE  # not float32
