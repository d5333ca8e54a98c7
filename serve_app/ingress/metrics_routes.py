"""`GET /metrics` (Prometheus text format) and an ASGI middleware that counts requests by API, status and tenant.

In a Serve replica, metrics are recorded through Ray (`serve_app/metrics.py`), so `/metrics` relays the exposition
of the metrics agent on the node this replica runs on: on a single-node `serve run` that is every replica's
service metrics, vLLM's engine metrics and Ray Serve's own, at one URL. On a multi-node cluster it shows one node
only; Prometheus scrapes every node's metrics port instead (kuberay/prometheus-podmonitor.yaml). Outside Ray (the
single-process server, unit tests) it serves this process's registries: the service's and vLLM's. The server wires the middleware with
`app.add_middleware(RequestMetricsMiddleware)`; it is pure ASGI, so streamed bodies pass through untouched.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from serve_app import metrics, request_log, tenants
from serve_app.errors import ServiceError
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


def _node_metrics_url() -> str:
    """The metrics agent of this process's Ray node (a blocking GCS call: run it off the event loop)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    (node,) = [n for n in ray.nodes() if n["NodeID"] == node_id]
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


_agent_url: str | None = None  # the node never changes under a running replica


async def _relay_node_metrics() -> Response:
    global _agent_url
    if _agent_url is None:
        _agent_url = await asyncio.to_thread(_node_metrics_url)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(_agent_url)
            r.raise_for_status()
    except httpx.HTTPError as e:
        raise ServiceError("api_error", f"the node's metrics agent did not answer: {e}", status=502) from e
    return Response(r.content, media_type=r.headers.get("content-type", CONTENT_TYPE_LATEST))


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics() -> Response:
    if metrics.in_ray_worker():
        return await _relay_node_metrics()
    # Outside Ray (the single-process server, unit tests): the service's registry, the engines' (one each:
    # engine/stat_logger.py) and prometheus_client's default one (the process's own metrics).
    from serve_app.engine.stat_logger import engine_metrics

    body = generate_latest(metrics.REGISTRY) + engine_metrics() + generate_latest(prometheus_client.REGISTRY)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


class RequestMetricsMiddleware:
    """Counts each HTTP request by API, final status and tenant, and tracks in-flight requests of this replica.

    The tenant is the one `check_api_key` set in `tenants.CURRENT` while handling the request: the route runs in
    this middleware's task, so the value is visible here after it returns ("none" when auth never ran)."""

    def __init__(self, app):
        self.app = app
        self.inflight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") == "/metrics":
            await self.app(scope, receive, send)
            return
        status = 500  # an app that raises before starting a response is a 500 to the client
        request_log.ARRIVED.set(time.monotonic())
        metrics.CURRENT_API.set(api_of(scope.get("path", "")))
        tenants.CURRENT.set(None)
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
            metrics.observe_request(api_of(scope.get("path", "")), status, tenants.CURRENT.get())
