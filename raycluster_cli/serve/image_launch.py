"""The launcher's image branch: a diffusers checkpoint (``model_index.json``) deployed as the images API.

The launcher (``python -m raycluster_cli.serve``) comes here when its ``model_path`` is a diffusers folder.  The
ingress places and times the replicas itself (serve/image_app.py), so this deploys it, waits until Ray Serve
reports it running (which is after a real image went through every replica), asks it for its placement through
the deployment handle, and prints one JSON line shaped like the text launcher's:

    {"url": ..., "model": ID, "kind": "image", "replicas": R, "split": null, "why": "...", "dtype": "float32",
     "image": {"steps": S, "size": P, "guidance_scale": G},
     "pipelines": [{"stages": [{"node_ip", "node_id", "parts"}, ...], "s_per_image": s, "why": "..."}, ...]}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ray
from ray import serve

from raycluster_cli.serve import revive
from raycluster_cli.serve.options import LaunchOptions

IMAGE_DTYPES = ("float32", "bfloat16")  # on CPU; float16 convolutions are not kernels every torch build has


def image_dtype(asked: str) -> str:
    """``auto`` is float32 (the replicas run on CPU); float16 is refused with the choices."""
    dtype = "float32" if asked == "auto" else asked
    if dtype not in IMAGE_DTYPES:
        raise SystemExit(
            f"serve: --dtype {asked} is not offered for images: use one of auto, {', '.join(IMAGE_DTYPES)}"
        )
    return dtype


def launch(
    options: LaunchOptions,
    keys_file: str | None,
    app_name: str,
    ingress_options: dict[str, Any],
    http_options: dict[str, Any],
) -> int:
    from raycluster_cli.diffusion.parts import check_scheduler
    from raycluster_cli.serve.image_app import ImageSettings, build_image_app, native_size
    from raycluster_cli.serve.image_limits import operator_problem

    try:
        check_scheduler(options.model_path)
    except ValueError as exc:
        raise SystemExit(f"serve: {exc}") from None
    size = options.image_size or native_size(options.model_path)
    problem = operator_problem(options.image_steps, size, options.image_max_steps, options.image_max_pixels)
    if problem is not None:
        raise SystemExit(f"serve: {problem}")
    settings = ImageSettings(
        model_path=options.model_path, model_id=options.model_id, keys_file=keys_file, dtype=image_dtype(options.dtype),
        steps=options.image_steps, guidance=options.guidance_scale, size=options.image_size or None,
        max_waiting=options.max_images_waiting, max_steps=options.image_max_steps, max_pixels=options.image_max_pixels,
    )  # fmt: skip
    ray.init(address="auto")
    serve.start(proxy_location=options.proxy_location, http_options=http_options)
    handle = serve.run(build_image_app(settings, ray_actor_options=ingress_options), name=app_name, route_prefix="/")
    placement = handle.describe.remote().result(timeout_s=120)
    scheme = "https" if http_options.get("ssl_certfile") else "http"
    url = f"{scheme}://{ray.util.get_node_ip_address()}:{options.port}/v1"
    reported = report(url, settings.served_model, placement)
    document = json.dumps(reported)
    if options.record:
        Path(options.record).write_text(document + "\n")
    if options.revive:
        revive.write(options.revive, options.model_dump(mode="json"), reported)
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
