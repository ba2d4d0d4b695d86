"""The commands the CLI prints to copy and paste: each value in them (a model's name, a URL, a path) is one shell
word, and inside `python -c` one Python string, so a model named like a command stays a name. Each printed line
is split as a POSIX shell splits it and its program parsed as Python reads it."""

from __future__ import annotations

import ast
import io
import json
import shlex
from typing import Any

from raycluster_cli.cli import lifecycle
from raycluster_cli.render.base import Output
from raycluster_cli.render.operate import render_serve

MODEL = "tiny'; touch /tmp/pwned; echo '\"$(id)\" `id` [bold]x\\"
URL = "http://192.0.2.10:8000/v1?a=1&b=$(id);"
TOKEN_FILE = "/state/my cluster/service-keys/default;id"
CERT_FILE = "/state/my cluster/service-tls/cert.pem && id"


def _printed(kind: str) -> list[str]:
    body = {"copies": [], "model": MODEL, "url": URL, "replicas": 1, "seconds": 1.0, "split": "even",
            "api_key_file": TOKEN_FILE, "tls_cert_file": CERT_FILE, "pipelines": [], "kind": kind}  # fmt: skip
    out = io.StringIO()
    render_serve(Output(False, stdout=out, stderr=io.StringIO()), body)
    return [line.strip() for line in out.getvalue().splitlines()]


def _keywords(program: str) -> dict[str, Any]:
    """Every keyword argument given a constant in `program` (a Python one-liner)."""
    found = {}
    for node in ast.walk(ast.parse(program)):
        if isinstance(node, ast.keyword) and isinstance(node.value, ast.Constant):
            found[node.arg] = node.value.value
    return found


def test_the_text_services_commands_keep_the_model_and_url_whole() -> None:
    lines = _printed("text")
    export, certs = (line for line in lines if line.startswith("export "))
    assert shlex.split(export) == ["export", f"OPENAI_API_KEY=$(cat {shlex.quote(TOKEN_FILE)})"]
    assert shlex.split(certs) == ["export", f"SSL_CERT_FILE={CERT_FILE}", f"CURL_CA_BUNDLE={CERT_FILE}"]
    curl = shlex.split(next(line for line in lines if line.startswith("curl ")))
    assert curl[:3] == ["curl", "-s", URL + "/chat/completions"]
    assert json.loads(curl[curl.index("-d") + 1])["model"] == MODEL
    python = shlex.split(next(line for line in lines if line.startswith("python ")))
    assert python[:2] == ["python", "-c"] and len(python) == 3
    assert _keywords(python[2]) | {"prompt": None} == {"base_url": URL, "model": MODEL, "prompt": None,
                                                       "max_tokens": 16}  # fmt: skip


def test_the_image_services_command_keeps_the_model_and_url_whole() -> None:
    python = shlex.split(next(line for line in _printed("image") if line.startswith("python ")))
    assert python[:2] == ["python", "-c"] and len(python) == 3
    keywords = _keywords(python[2])
    assert (keywords["base_url"], keywords["model"]) == (URL, MODEL)


def test_a_plain_model_reads_as_before() -> None:
    """Quoting changes nothing a person sees for an ordinary name and URL."""
    body = {"copies": [], "model": "tiny-gpt2", "url": "http://192.0.2.10:8000/v1", "replicas": 1, "seconds": 1.0,
            "split": "even", "pipelines": []}  # fmt: skip
    out = io.StringIO()
    render_serve(Output(False, stdout=out, stderr=io.StringIO()), body)
    assert "curl -s http://192.0.2.10:8000/v1/chat/completions -H" in out.getvalue()
    assert 'OpenAI(base_url="http://192.0.2.10:8000/v1").completions.create(model="tiny-gpt2"' in out.getvalue()


def test_the_next_steps_after_up_quote_paths() -> None:
    inventory = "my inventory;rm -rf ~.yaml"
    steps = lifecycle._next_steps("192.0.2.11", 6379, "http://192.0.2.11:8265", TOKEN_FILE, inventory)
    submit = shlex.split(steps["submit_job"])
    assert submit[:2] == ["RAY_AUTH_MODE=token", f"RAY_AUTH_TOKEN_PATH={TOKEN_FILE}"]
    assert shlex.split(steps["status"]) == ["raycluster", "status", "-i", inventory]
    assert shlex.split(steps["logs"]) == ["raycluster", "logs", "-i", inventory]
