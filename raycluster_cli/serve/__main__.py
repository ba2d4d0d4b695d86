"""``python -m raycluster_cli.serve``: deploy the service on the Ray cluster this node belongs to.

Run inside a node's container (or as a Ray job): it connects to the running cluster, starts Ray
Serve's HTTP proxy on ``--host:--port``, deploys the model and returns once a real generation went
through every stage, printing one JSON line (url, model, split).  The application outlives this
process, as Ray Serve applications do; ``serve.delete`` or ``serve shutdown`` removes it.  The bearer
token is the cluster's own (``$RAY_AUTH_TOKEN_PATH``) unless ``--token-file`` names another.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import ray
from ray import serve

from raycluster_cli.bench.model import config_from_checkpoint
from raycluster_cli.serve.app import ServeSettings, build_app
from raycluster_cli.serve.scheduler import Limits
from raycluster_cli.serve.stages import split_units

APP_NAME = "raycluster"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m raycluster_cli.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True, help="a Hugging Face checkpoint folder on every node")
    p.add_argument("--model-id", default="", help="the name clients pass as model (default: the folder's name)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("--split", default="", help="blocks per stage, e.g. 4,3,3 (default: even)")
    p.add_argument("--slots", type=int, default=16, help="sequences batched at once (KV cache slots)")
    p.add_argument("--max-seq", type=int, default=512, help="prompt + generated tokens per sequence")
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument("--token-file", default=os.environ.get("RAY_AUTH_TOKEN_PATH", ""))
    p.add_argument("--no-auth", action="store_true", help="accept requests without a token (loopback tests only)")
    p.add_argument("--record", default="", help="also write the JSON document to this file (for `raycluster status`)")
    p.add_argument(
        "--proxy-location",
        default="HeadOnly",
        help="Ray Serve's HTTP proxies: HeadOnly (one, on --host) or EveryNode (then --host must be 0.0.0.0)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    token = None
    if not args.no_auth:
        if not args.token_file:
            print("serve: no token: pass --token-file (or set RAY_AUTH_TOKEN_PATH), or --no-auth", file=sys.stderr)
            return 2
        token = Path(args.token_file).read_text().strip()
    split = tuple(int(c) for c in args.split.split(",")) if args.split else None
    settings = ServeSettings(
        model_path=args.model_path,
        model_id=args.model_id,
        token=token,
        stages=args.stages,
        split=split,
        limits=Limits(slots=args.slots, max_seq=args.max_seq, prefill_chunk=args.prefill_chunk),
    )
    layers = config_from_checkpoint(args.model_path, max_seq=args.max_seq).layers
    ranges = split_units(layers, args.stages, split)  # a bad split fails here, before anything starts
    ray.init(address="auto")
    serve.start(proxy_location=args.proxy_location, http_options={"host": args.host, "port": args.port})
    serve.run(build_app(settings), name=APP_NAME, route_prefix="/")
    url = f"http://{ray.util.get_node_ip_address()}:{args.port}/v1"
    document = json.dumps({"url": url, "model": settings.served_model, "split": ranges, "replicas": 1})
    if args.record:
        Path(args.record).write_text(document + "\n")
    print(document)
    return 0


if __name__ == "__main__":
    sys.exit(main())
