"""Builds the FastAPI app: every API's routes, each answering errors in its own envelope (ingress/envelope.py)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.ingress import metrics_routes, models_routes, tokens_routes
from serve_app.ingress.anthropic import routes as anthropic_routes
from serve_app.ingress.chat import routes as chat_routes
from serve_app.ingress.context import IngressContext
from serve_app.ingress.envelope import Envelope, anthropic_envelope, as_service_error, unrouted_envelope
from serve_app.ingress.front_door_reports import FrontDoorReportsMiddleware
from serve_app.ingress.limits import RateLimitHeadersMiddleware
from serve_app.ingress.metrics_routes import RequestMetricsMiddleware
from serve_app.ingress.responses import routes as responses_routes

# Every route module's router, in registration order.
ROUTERS = [
    models_routes.router,
    chat_routes.router,
    tokens_routes.router,
    anthropic_routes.router,
    responses_routes.router,
    metrics_routes.router,
]

# Whose envelope answers a request that matched no route (a 404, or a 405 for a known path): by path prefix.
UNROUTED: list[tuple[str, Envelope]] = [("/v1/messages", anthropic_envelope)]


def create_app(ctx: IngressContext) -> FastAPI:
    app = FastAPI(title="serve_app", docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.add_middleware(RequestMetricsMiddleware)
    app.add_middleware(RateLimitHeadersMiddleware)
    engines = getattr(ctx.service, "engines", None)
    if ctx.settings.router.front_door and hasattr(engines, "settle"):
        app.add_middleware(FrontDoorReportsMiddleware, engines=engines)
    for router in ROUTERS:
        app.include_router(router)

    @app.exception_handler(StarletteHTTPException)
    async def _unrouted(request: Request, exc: StarletteHTTPException):
        return unrouted_envelope(request, UNROUTED)(request, as_service_error(request, exc))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # outside any route (middleware): still an envelope
        return unrouted_envelope(request, UNROUTED)(request, as_service_error(request, exc))

    return app
