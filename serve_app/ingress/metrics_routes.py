"""`GET /metrics` (Prometheus text format) and an ASGI middleware that counts requests by API and status.

`/metrics` shows this ingress replica's process registry; the cluster-wide sum of the same metrics is exported by
Ray's metrics agent on every node (see `serve_app/metrics.py`). The server wires the middleware with
`app.add_middleware(RequestMetricsMiddleware)`; it is pure ASGI, so streamed bodies pass through untouched.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from serve_app import metrics
from serve_app.ingress.envelope import api_router, openai_envelope

router = api_router(openai_envelope)

_API_PREFIXES = (
    ("/v1/messages", "anthropic"),
    ("/v1/responses", "responses"),
    ("/v1/chat/completions", "chat"),
    ("/v1/completions", "completions"),
    ("/v1/models", "models"),
)


def api_of(path: str) -> str:
    for prefix, api in _API_PREFIXES:
        if path.startswith(prefix):
            return api
    return "other"


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics() -> Response:
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


class RequestMetricsMiddleware:
    """Counts each HTTP request by API and final status, and tracks in-flight requests of this replica."""

    def __init__(self, app):
        self.app = app
        self.inflight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") == "/metrics":
            await self.app(scope, receive, send)
            return
        status = 500  # an app that raises before starting a response is a 500 to the client
        metrics.CURRENT_API.set(api_of(scope.get("path", "")))
        self.inflight += 1
        metrics.set_inflight(self.inflight)

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.inflight -= 1
            metrics.set_inflight(self.inflight)
            metrics.observe_request(api_of(scope.get("path", "")), status)
