"""GET /health (readiness; also /health/ready), GET /health/live, GET /v1/models, GET /v1/models/{id} (OpenAI
shape, Anthropic shape with `anthropic-version`, plus Codex's `models` array)."""

from __future__ import annotations

import calendar
import time
from typing import Any

from fastapi import Depends, Request
from starlette.responses import JSONResponse

from serve_app import tenants
from serve_app.codex import codex_models_payload
from serve_app.errors import ModelNotFound
from serve_app.ingress.anthropic import models as anthropic_models
from serve_app.ingress.auth import check_api_key
from serve_app.ingress.context import IngressContext, get_ctx
from serve_app.ingress.envelope import api_router, by_anthropic_header
from serve_app.settings import ModelConfig

router = api_router(by_anthropic_header)


def _epoch(created_at: str) -> int:
    try:
        return calendar.timegm(time.strptime(created_at[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return 0


def openai_model(model_id: str, m: ModelConfig) -> dict[str, Any]:
    return {
        "id": model_id,
        "object": "model",
        "created": _epoch(m.created_at),
        "owned_by": "serve_app",
        "root": m.model_source,
        "parent": None if model_id == m.id else m.id,
        "max_model_len": m.max_model_len,
        "context_window": m.max_model_len,
        "max_output_tokens": m.max_output_tokens,
        "reasoning_parser": m.reasoning_parser,
        "tool_parser": m.tool_parser,
    }


def _served(ctx: IngressContext) -> list[tuple[str, ModelConfig]]:
    return [(mid, m) for m in ctx.settings.models for mid in m.all_ids]


@router.get("/health/live")
async def live(ctx: IngressContext = Depends(get_ctx)):
    """Liveness: this ingress replica answers (whatever the engines are doing)."""
    return {"status": "ok", "models": [m.id for m in ctx.settings.models]}


@router.get("/health")
@router.get("/health/ready")
async def ready(ctx: IngressContext = Depends(get_ctx)):
    """Readiness: 200 only when every engine deployment has a replica whose vLLM engine answers its health check;
    503 naming the ones that don't. `/health` is this check, not liveness, because that is what a newcomer and a
    load balancer poll before the first request: the ingress starts in seconds, the engines in minutes, and a
    request sent in between waits for them. Serve's own `/-/healthz` says only that an ingress replica is up."""
    engines = await ctx.service.readiness()
    ok = all(v is None for v in engines.values())
    body = {"status": "ready" if ok else "not_ready",
            "engines": {key: "ok" if err is None else err for key, err in engines.items()}}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/v1/models")
async def list_models(request: Request, ctx: IngressContext = Depends(get_ctx)):
    tenant = check_api_key(request.headers, ctx.settings.ingress.api_keys)
    served = [(mid, m) for mid, m in _served(ctx) if tenants.allows(ctx.settings.ingress, tenant, m)]
    if "anthropic-version" in request.headers:
        return JSONResponse(anthropic_models.model_list(served, dict(request.query_params)))
    body: dict[str, Any] = {"object": "list", "data": [openai_model(mid, m) for mid, m in served]}
    allowed = [m for m in ctx.settings.models if tenants.allows(ctx.settings.ingress, tenant, m)]
    body["models"] = codex_models_payload(allowed)
    return JSONResponse(body)


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request, ctx: IngressContext = Depends(get_ctx)):
    tenant = check_api_key(request.headers, ctx.settings.ingress.api_keys)
    m = ctx.settings.find_model(model_id)
    if m is None or not tenants.allows(ctx.settings.ingress, tenant, m):
        raise ModelNotFound(model_id)
    if "anthropic-version" in request.headers:
        return JSONResponse(anthropic_models.model_object(model_id, m))
    return JSONResponse(openai_model(model_id, m))
