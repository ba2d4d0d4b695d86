"""The launcher's image branch: a diffusers checkpoint (``model_index.json``) deployed as the images API.

``python -m raycluster_cli.serve --model-path DIR`` comes here when DIR is a diffusers folder.  The ingress places
and times the replicas itself (serve/image_app.py), so this deploys it, waits until Ray Serve reports it running
(which is after a real image went through every replica), asks it for its placement through the deployment
handle, and prints one JSON line shaped like the text launcher's:

    {"url": ..., "model": ID, "kind": "image", "replicas": R, "split": null, "why": "...", "dtype": "float32",
     "image": {"steps": S, "size": P, "guidance_scale": G},
     "pipelines": [{"stages": [{"node_ip", "node_id", "parts"}, ...], "s_per_image": s, "why": "..."}, ...]}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import ray
from ray import serve

IMAGE_DTYPES = ("float32", "bfloat16")  # on CPU; float16 convolutions are not kernels every torch build has


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("images (a diffusers checkpoint)")
    group.add_argument("--image-steps", type=int, default=20, help="denoising steps when a request gives none")
    group.add_argument("--image-size", type=int, default=0, help="default width and height (0: the checkpoint's)")
    group.add_argument("--guidance-scale", type=float, default=7.5, help="when a request gives none")
    group.add_argument(
        "--max-images-waiting", type=float, default=64,
        help="work held before requests get 503, in images of the default steps and size (an image of twice the "
        "steps counts two)",
    )  # fmt: skip
    group.add_argument(
        "--image-max-steps", type=int, default=150, help="the most num_inference_steps a request may ask (else 400)"
    )
    group.add_argument(
        "--image-max-pixels", type=int, default=1024 * 1024,
        help="the most width × height a request may ask (else 400; also bounded by the memory a replica measured)",
    )  # fmt: skip


def image_dtype(asked: str) -> str:
    """``auto`` is float32 (the replicas run on CPU); float16 is refused with the choices."""
    dtype = "float32" if asked == "auto" else asked
    if dtype not in IMAGE_DTYPES:
        raise SystemExit(
            f"serve: --dtype {asked} is not offered for images: use one of auto, {', '.join(IMAGE_DTYPES)}"
        )
    return dtype


def launch(
    args: argparse.Namespace,
    keys_file: str | None,
    app_name: str,
    ingress_options: dict[str, Any],
    http_options: dict[str, Any],
) -> int:
    from raycluster_cli.diffusion.parts import check_scheduler
    from raycluster_cli.serve.image_app import ImageSettings, build_image_app, native_size
    from raycluster_cli.serve.image_limits import operator_problem

    if args.image_size and (args.image_size < 8 or args.image_size % 8):
        raise SystemExit(f"serve: --image-size {args.image_size} must be a multiple of 8")
    try:
        check_scheduler(args.model_path)
    except ValueError as exc:
        raise SystemExit(f"serve: {exc}") from None
    size = args.image_size or native_size(args.model_path)
    problem = operator_problem(args.image_steps, size, args.image_max_steps, args.image_max_pixels)
    if problem is not None:
        raise SystemExit(f"serve: {problem}")
    settings = ImageSettings(
        model_path=args.model_path, model_id=args.model_id, keys_file=keys_file, dtype=image_dtype(args.dtype),
        steps=args.image_steps, guidance=args.guidance_scale, size=args.image_size or None,
        max_waiting=args.max_images_waiting, max_steps=args.image_max_steps, max_pixels=args.image_max_pixels,
    )  # fmt: skip
    ray.init(address="auto")
    serve.start(proxy_location=args.proxy_location, http_options=http_options)
    handle = serve.run(build_image_app(settings, ray_actor_options=ingress_options), name=app_name, route_prefix="/")
    placement = handle.describe.remote().result(timeout_s=120)
    scheme = "https" if http_options.get("ssl_certfile") else "http"
    url = f"{scheme}://{ray.util.get_node_ip_address()}:{args.port}/v1"
    document = json.dumps(report(url, settings.served_model, placement))
    if args.record:
        Path(args.record).write_text(document + "\n")
    print(document)
    return 0


def report(url: str, model: str, placement: dict[str, Any]) -> dict[str, Any]:
    pipelines = placement["pipelines"]
    return {
        "url": url, "model": model, "kind": "image", "replicas": len(pipelines), "split": None,
        "why": placement["why"], "dtype": placement["dtype"], "image": placement["calibration"],
        "pipelines": [
            {"stages": p["stages"], "s_per_image": p["s_per_image"], "why": p["why"]} for p in pipelines
        ],
    }  # fmt: skip
