"""What one image request may ask of the image service: bounds on its steps and size, and the memory its size needs.

A client chooses an image's cost (``num_inference_steps`` × width × height), so the service bounds both, at limits
the operator sets and may raise (``serve --image-max-steps / --image-max-pixels``): a request past one is a 400
naming the field and the flag.  A size within the bounds must also fit the memory a replica's node has left beside
its weights: each worker measures what its calibration image took beyond the loaded weights
(``diffusion_workers.memory``), which scales with the image's pixels (the UNet's and VAE's activations; attention
runs through PyTorch's memory-efficient kernel, linear in the pixels), so a replica holds images of up to
``room / (bytes per pixel × MEMORY_MARGIN)`` pixels.  The per-pixel figure includes the calibration's fixed
overhead, so it errs towards refusing.  Where the peak could not be measured, ``placing.activation_bytes`` (the
placement's model of the activations) stands in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from raycluster_cli.diffusion import placing
from raycluster_cli.serve.protocol import APIError

MIB = 1024 * 1024
MEMORY_MARGIN = 1.25  # allocator slack over the measured per-pixel working memory
STEPS_CEILING = 10_000  # what the request shape takes at all (protocol.ImageGenerationRequest)


def largest_side(max_pixels: int, multiple: int) -> int:
    """The widest side a request may ask: twice the square's side at ``max_pixels`` (2048 × 512 within 1024²)."""
    return max(multiple, 2 * math.isqrt(max_pixels) // multiple * multiple)


def check_steps(steps: int, max_steps: int) -> None:
    if steps > max_steps:
        raise APIError(
            400,
            f"num_inference_steps {steps}: this service makes at most {max_steps} steps an image (the operator "
            "may raise it with serve --image-max-steps)",
            param="num_inference_steps",
        )


def check_pixels(width: int, height: int, max_pixels: int) -> None:
    if width * height > max_pixels:
        side = math.isqrt(max_pixels)
        raise APIError(
            400,
            f"size {width}x{height} is {width * height} pixels: this service makes at most {max_pixels} "
            f"(e.g. {side}x{side}; the operator may raise it with serve --image-max-pixels)",
            param="size",
        )


def check_memory(width: int, height: int, slots: Sequence[Any]) -> None:
    """A 400 naming ``size`` when an image this size would not fit the memory some live replica has left (any of
    them may be given it): with its measured bytes per pixel, and the most pixels that fit there."""
    pixels = width * height
    for slot in slots:
        fits, per_pixel = slot.limits.get("fits_pixels"), slot.limits.get("work_bytes_per_pixel")
        if fits is None or per_pixel is None or pixels <= fits:
            continue
        side = math.isqrt(int(fits))
        raise APIError(
            400,
            f"size {width}x{height} needs about {pixels * per_pixel * MEMORY_MARGIN / MIB:.0f} MiB of working "
            f"memory an image ({per_pixel:.0f} bytes a pixel, measured at calibration) and replica {slot.index} "
            f"has room for {fits} pixels (e.g. {side}x{side}): ask for a smaller size",
            param="size",
        )


def replica_limits(
    memory: Sequence[dict[str, Any]], rooms: dict[str, int], holders: Sequence[tuple[str, list[str]]],
    weights: dict[str, int], pixels: int,
) -> dict[str, Any]:  # fmt: skip
    """The most pixels an image may have on one replica: over its actors (each on its node, ``holders`` in
    order), the node's room (``rooms``: bytes a part may take there) less its parts' weights, over the bytes per
    pixel its calibration image (``pixels``) took (``memory``: each actor's ``DiffusionWorker.memory``)."""
    fits: list[int] = []
    per_pixel_most, source = 0.0, "measured"
    for (node_id, parts), measured in zip(holders, memory, strict=True):
        work = measured.get("work_bytes")
        if not work:  # not measured: the placement's model of the activations at the calibration's size
            source = "estimate"
            act = placing.activation_bytes(math.isqrt(pixels))
            work = act if "unet" in parts else act // 4
        per_pixel = work / pixels
        left = rooms.get(node_id, 0) - int(sum(weights.get(p, 0) for p in parts) * placing.WEIGHT_HEADROOM)
        fits.append(max(0, int(left / (per_pixel * MEMORY_MARGIN))))
        per_pixel_most = max(per_pixel_most, per_pixel)
    return {"fits_pixels": min(fits), "work_bytes_per_pixel": round(per_pixel_most, 1), "memory_source": source}


def operator_problem(steps: int, size: int, max_steps: int, max_pixels: int) -> str | None:
    """Why the launcher's flags cannot serve the service's own defaults, in one line; None when they can."""
    if not 1 <= max_steps <= STEPS_CEILING:
        return f"--image-max-steps {max_steps} must be between 1 and {STEPS_CEILING}"
    if steps > max_steps:
        return f"--image-steps {steps} is over --image-max-steps {max_steps}: raise the bound or lower the default"
    if size * size > max_pixels:
        return (
            f"--image-max-pixels {max_pixels} is below the default size {size}x{size} ({size * size} pixels): "
            "raise it or pass a smaller --image-size"
        )
    return None
