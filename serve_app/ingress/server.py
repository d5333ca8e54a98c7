"""Builds the FastAPI app: every route module's router, and errors in each API's own envelope."""

from __future__ import annotations

import importlib
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from serve_app.errors import ServiceError
from serve_app.ingress.chat.encode import error_body
from serve_app.ingress.context import IngressContext

log = logging.getLogger(__name__)

# Route modules, each exposing `router`. Optional ones are skipped when absent so a partial checkout still serves.
ROUTE_MODULES = [
    "serve_app.ingress.models_routes",
    "serve_app.ingress.chat.routes",
    "serve_app.ingress.tokens_routes",
    "serve_app.ingress.anthropic.routes",
    "serve_app.ingress.responses.routes",
    "serve_app.ingress.metrics_routes",
]

ANTHROPIC_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "request_too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "overloaded": "overloaded_error",
    "timeout": "api_error",
    "api_error": "api_error",
}


def is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers


def error_response(request: Request, err: ServiceError) -> JSONResponse:
    headers: dict[str, str] = {}
    if err.retry_after is not None:
        headers["retry-after"] = str(max(1, int(round(err.retry_after))))
    if is_anthropic(request):
        rid = f"req_{uuid.uuid4().hex[:24]}"
        headers["request-id"] = rid
        body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(err.kind, "api_error"), "message": err.message},
                "request_id": rid}
    else:
        body = error_body(err.kind, err.message, err.param, err.code)
    return JSONResponse(body, status_code=err.status, headers=headers)


def create_app(ctx: IngressContext) -> FastAPI:
    app = FastAPI(title="serve_app", docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    from serve_app.ingress.metrics_routes import RequestMetricsMiddleware

    app.add_middleware(RequestMetricsMiddleware)
    from serve_app.ingress.limits import RateLimitHeadersMiddleware

    app.add_middleware(RateLimitHeadersMiddleware)
    for name in ROUTE_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):
                continue  # that API is not in this checkout
            raise
        app.include_router(module.router)

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(request, ServiceError("invalid_request", f"{loc}: {first.get('msg', 'invalid')}", param=loc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 405: "invalid_request", 401: "authentication", 413: "request_too_large"}.get(
            exc.status_code, "invalid_request" if exc.status_code < 500 else "api_error")
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(request, ServiceError(kind, message, status=exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request, ServiceError("api_error", f"internal error: {type(exc).__name__}"))

    return app
