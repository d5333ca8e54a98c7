"""Errors in the envelope of the API whose route failed.

Each API's routes live on `api_router(envelope)`: a `ServiceError` (or a bug) raised by one of its handlers is
answered by that API's own envelope, chosen by the route, never guessed from the URL or headers. Only a request
that matched no route (404, 405) has no owner; `unrouted_envelope` picks one from the path prefixes the APIs
register in `server.py`, and from the `anthropic-version` header for the rest.
"""

from __future__ import annotations

import logging
from typing import Callable

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import Response

from serve_app.errors import ServiceError
from serve_app.ingress.anthropic.errors import error_response as anthropic_error
from serve_app.ingress.common import invalid_request
from serve_app.ingress.openai_errors import error_response as openai_error

log = logging.getLogger(__name__)

Envelope = Callable[[Request, ServiceError], Response]


def openai_envelope(request: Request, err: ServiceError) -> Response:
    return openai_error(err)


def responses_envelope(request: Request, err: ServiceError) -> Response:
    return openai_error(err, responses=True)  # Responses' own words for a prompt too long, blamed on `input`


def anthropic_envelope(request: Request, err: ServiceError) -> Response:
    return anthropic_error(err, getattr(request.state, "request_id", None))


def by_anthropic_header(request: Request, err: ServiceError) -> Response:
    """For routes that serve both shapes (`/v1/models`): the shape the client asked for is the error's too."""
    return (anthropic_envelope if "anthropic-version" in request.headers else openai_envelope)(request, err)


def as_service_error(request: Request, exc: Exception) -> ServiceError:
    """Any exception a handler raised, as the ServiceError to answer with."""
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, RequestValidationError):
        return invalid_request(exc.errors(), {"body": exc.body})
    if isinstance(exc, HTTPException):
        kind = {404: "not_found", 405: "invalid_request", 401: "authentication", 413: "request_too_large"}.get(
            exc.status_code, "invalid_request" if exc.status_code < 500 else "api_error")
        return ServiceError(kind, f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code)
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return ServiceError("api_error", f"internal error: {type(exc).__name__}")


def api_router(envelope: Envelope) -> APIRouter:
    """An APIRouter whose handlers' errors are answered in `envelope`."""

    class Route(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def run(request: Request) -> Response:
                try:
                    return await handler(request)
                except Exception as exc:  # noqa: BLE001 - every failure gets the API's envelope
                    return envelope(request, as_service_error(request, exc))

            return run

    return APIRouter(route_class=Route)


def unrouted_envelope(request: Request, prefixes: list[tuple[str, Envelope]]) -> Envelope:
    """The envelope for a request no route took (404/405): the API that owns its path prefix, if any."""
    path = request.url.path
    for prefix, envelope in prefixes:
        if path.startswith(prefix):
            return envelope
    return by_anthropic_header
