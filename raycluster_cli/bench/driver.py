"""``python -m raycluster_cli.bench.driver --options JSON``: run the benchmark on the Ray cluster.

Runs inside the head container, connects to the running cluster and prints exactly one JSON document
on stdout; everything else goes to stderr.  To make that hold even for output from C extensions and
Ray itself, file descriptor 1 is pointed at stderr for the whole run and the JSON is written to a
saved copy of the original fd.  The options are ``BenchOptions`` as JSON (``--options '{...}'`` or
``--options @FILE``), exactly as the CLI validated them.  ``--progress FILE`` appends one JSON line
per phase change and a few per second while requests complete (the CLI polls that file).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from raycluster_cli import __version__
from raycluster_cli.bench.options import BenchOptions, ValidationError
from raycluster_cli.schema import SCHEMA_VERSION

log = logging.getLogger("raycluster.bench")


class _UsageError(Exception):
    pass


class _JsonArgumentParser(argparse.ArgumentParser):
    """Usage errors become the same one-line JSON error as everything else (exit 1)."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _JsonArgumentParser(prog="python -m raycluster_cli.bench.driver", description=__doc__)
    p.add_argument("--options", default="{}", help="BenchOptions as JSON, or @FILE holding it")
    p.add_argument("--progress", default=None, help="append progress events (JSON lines) to this file")
    return p


def parse_options(text: str) -> BenchOptions:
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    try:
        return BenchOptions.model_validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "options"
        if first["type"] == "extra_forbidden":  # the operator's CLI is newer than the node image's copy
            raise _UsageError(
                f"{where}: unknown to raycluster {__version__} in the node image, older than the CLI that sent it; "
                "rebuild the node image from the CLI's version (scripts/build-images.sh) and run `raycluster up`"
            ) from None
        raise _UsageError(f"{where}: {first['msg']}") from None


class ProgressFile:
    """Progress events as JSON lines: ``{"phase", "done", "total", "t"}`` plus what the phase adds."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def __call__(self, phase: str, done: int | None = None, total: int | None = None, **extra: Any) -> None:
        event = {"phase": phase, "done": done, "total": total, "t": round(time.time(), 3), **extra}
        log.info("progress %s", json.dumps(event))
        if self.path:
            with open(self.path, "a") as handle:
                handle.write(json.dumps(event) + "\n")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:2000]


def _failure_doc(exc: BaseException) -> dict[str, Any]:
    doc: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "ok": False, "error": _one_line(exc)}
    failure = getattr(exc, "failure", None)  # runtime.StageLost: which node, which stage, how far it got
    if isinstance(failure, dict):
        doc["error"] = str(exc)
        doc["failure"] = failure
    return doc


def _run_to_doc(argv: list[str] | None) -> tuple[dict[str, Any], int]:
    try:
        args = build_parser().parse_args(argv)
        options = parse_options(args.options)
        from raycluster_cli.bench import session

        return session.run(options, ProgressFile(args.progress)), 0
    except (Exception, KeyboardInterrupt) as exc:  # the CLI wants one JSON document, whatever happened
        expected = isinstance(exc, _UsageError | ValueError) or hasattr(exc, "failure")
        log.error("benchmark failed", exc_info=not expected)
        return _failure_doc(exc), 1
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        except Exception:  # shutdown problems must not hide the result
            log.warning("ray.shutdown failed", exc_info=True)


def main(argv: list[str] | None = None) -> int:
    sys.stdout.flush()
    json_fd = os.dup(1)
    os.dup2(2, 1)  # anything else that writes to stdout now lands on stderr
    try:
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
        doc, code = _run_to_doc(argv)
        sys.stdout.flush()
        os.write(json_fd, (json.dumps(doc) + "\n").encode())
    finally:
        os.dup2(json_fd, 1)
        os.close(json_fd)
    return code


if __name__ == "__main__":
    sys.exit(main())
