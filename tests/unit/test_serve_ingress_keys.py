"""The one key check both ingresses share (serve/ingress.py): the text ingress's and the image ingress's own FastAPI
applications, in process, refuse a missing key, a wrong one and the Ray cluster's token on every route but /health,
with the same OpenAI-shaped body; a service key is let through as its own entry.

The keys are a real keys document and a real token file, handed to the applications as the replica's keys
(``dependency_overrides[current_keys]``: outside Ray Serve there is no replica to ask).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import Depends
from starlette.testclient import TestClient

from raycluster_cli import apikeys
from raycluster_cli.serve import app as text_app
from raycluster_cli.serve import image_app
from raycluster_cli.serve.auth import ServiceKeys
from raycluster_cli.serve.ingress import current_keys, openai_api, service_key

RAY_TOKEN = "ray-cluster-token-0123456789abcdef"
TEXT_ROUTES = [
    ("get", "/v1/models"),
    ("get", "/v1/models/some/model"),
    ("get", "/raycluster/status?since=1"),
    ("post", "/v1/completions"),
    ("post", "/v1/chat/completions"),
]
IMAGE_ROUTES = [
    ("get", "/v1/models"),
    ("get", "/v1/models/some/model"),
    ("get", "/raycluster/status"),
    ("post", "/v1/images/generations"),
]


@pytest.fixture
def keys(tmp_path: Path) -> tuple[ServiceKeys, str]:
    key = apikeys.new_key()
    path, token = tmp_path / "keys.json", tmp_path / "auth-token"
    path.write_text(apikeys.render_keys([apikeys.KeyEntry.make("team-a", key)]))
    token.write_text(RAY_TOKEN + "\n")
    return ServiceKeys(str(path), str(token)), key


@pytest.fixture
def clients(keys: tuple[ServiceKeys, str]) -> Iterator[list[tuple[TestClient, list[tuple[str, str]]]]]:
    apps = [(text_app.app, TEXT_ROUTES), (image_app.image_api, IMAGE_ROUTES)]
    for api, _ in apps:
        api.dependency_overrides[current_keys] = lambda: keys[0]
    try:
        yield [(TestClient(api), routes) for api, routes in apps]
    finally:
        for api, _ in apps:
            api.dependency_overrides.pop(current_keys, None)


def _answers(clients: list[tuple[TestClient, list[tuple[str, str]]]], headers: dict[str, str]) -> list[Any]:
    """Every keyed route's (status, body) on both ingresses for one request's headers."""
    return [_ask(client, method, path, headers) for client, routes in clients for method, path in routes]


def _ask(client: TestClient, method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    answer = client.request(method, path, headers=headers, json={"model": "m", "prompt": "hi"})
    return answer.status_code, answer.json()


def test_both_ingresses_refuse_a_missing_key_and_the_ray_token_with_the_same_body(
    clients: list[tuple[TestClient, list[tuple[str, str]]]], keys: tuple[ServiceKeys, str]
) -> None:
    missing = {
        "error": {
            "message": "missing or wrong API key: send Authorization: Bearer <a service key>",
            "type": "authentication_error",
            "param": None,
            "code": None,
        }
    }
    for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": f"Basic {keys[1]}"}, {"Authorization": "x"}):
        assert set(map(repr, _answers(clients, headers))) == {repr((401, missing))}, headers
    wrong = _answers(clients, {"Authorization": f"Bearer {apikeys.new_key()}"})
    assert set(map(repr, wrong)) == {repr((401, missing))}
    ray = _answers(clients, {"Authorization": f"Bearer {RAY_TOKEN}"})
    assert len(set(map(repr, ray))) == 1
    status, body = ray[0]
    assert status == 401 and "the Ray cluster's token" in body["error"]["message"]
    assert body["error"]["type"] == "authentication_error"


def test_both_ingresses_refuse_the_disconnect_opt_out_even_with_a_key(
    clients: list[tuple[TestClient, list[tuple[str, str]]]], keys: tuple[ServiceKeys, str]
) -> None:
    headers = {"Authorization": f"Bearer {keys[1]}", "x-request-disconnect-disabled": "?1"}
    answers = _answers(clients, headers)
    assert len(set(map(repr, answers))) == 1
    status, body = answers[0]
    assert status == 400 and body["error"]["param"] == "x-request-disconnect-disabled"


def test_a_service_key_passes_as_its_own_entry(keys: tuple[ServiceKeys, str]) -> None:
    api = openai_api("test")

    @api.get("/who")
    async def who(key: Any = Depends(service_key)) -> dict[str, str]:
        return {"name": key.name}

    api.dependency_overrides[current_keys] = lambda: keys[0]
    client = TestClient(api)
    assert client.get("/who", headers={"Authorization": f"Bearer {keys[1]}"}).json() == {"name": "team-a"}
    assert client.get("/who", headers={"Authorization": f"bearer  {keys[1]} "}).json() == {"name": "team-a"}
    assert client.get("/who").status_code == 401


def test_the_image_ingress_does_not_import_the_text_ingress() -> None:
    tree = ast.parse(inspect.getsource(image_app))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "raycluster_cli.serve.app" not in modules and "app" not in imported
