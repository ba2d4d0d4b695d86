"""What both ingresses (text: serve/app.py, images: serve/image_app.py) share at the HTTP door: the key check and
the error shape.

So the two services answer a caller the same way, from one place: every route but ``/health`` declares ``KEYED``
(FastAPI's own ``HTTPBearer`` reads the ``Authorization`` header; the service's keys, serve/auth.py, judge it), and
every error leaves in OpenAI's shape (``{"error": {...}}``, what the ``openai`` client raises).  ``HTTPBearer`` runs
with ``auto_error=False``: its own 403 would not be OpenAI's 401 that names what to send.

The key check runs before the route's own parameters: a refused request touches nothing of the ingress but its
keys.  The keys are the serving replica's (``serve.get_replica_context()``, as Ray Serve finds the route's ``self``),
so the dependency needs no global state; a test hands its own through ``dependency_overrides[current_keys]``.

No ``from __future__ import annotations``: FastAPI reads the dependencies' annotations at runtime.
"""

from typing import Any, Protocol, cast

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException

from raycluster_cli.apikeys import KeyEntry
from raycluster_cli.serve.auth import ServiceKeys, refuse_disconnect_disabled
from raycluster_cli.serve.protocol import APIError

bearer = HTTPBearer(auto_error=False)


class Keyed(Protocol):
    """An ingress: it holds the service's keys."""

    keys: ServiceKeys


def current_keys() -> ServiceKeys:
    """The keys of the ingress serving this request (the replica's own object)."""
    from ray import serve

    return cast(Keyed, serve.get_replica_context().servable_object).keys


async def service_key(
    request: Request,
    credentials: HTTPAuthorizationCredentials | None = Depends(bearer),
    keys: ServiceKeys = Depends(current_keys),
) -> KeyEntry:
    """The caller's key, or 401 saying what to send (the Ray cluster's token refused by name); 400 for a client that
    opts out of the disconnect watch (its generation would outlive it)."""
    refuse_disconnect_disabled(request.headers)
    return keys.check_bearer(credentials.credentials if credentials is not None else None)


KEYED: Any = [Depends(service_key)]  # a route's ``dependencies``: checked before its own parameters


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(APIError(400, str(exc.errors()[:1])).body(), status_code=400)


async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


def openai_api(title: str) -> FastAPI:
    """An ingress's FastAPI application: OpenAI's error shape for every error, and no /docs, /redoc or
    /openapi.json (the service's surface is OpenAI's API, and nothing answers without a key but /health)."""
    api = FastAPI(title=title, docs_url=None, redoc_url=None, openapi_url=None)
    api.exception_handler(APIError)(_api_error)
    api.exception_handler(RequestValidationError)(_invalid)
    api.exception_handler(HTTPException)(_http_error)
    return api
