"""POST /v1/responses, GET and DELETE /v1/responses/{id} (OpenAI Responses API, as Codex CLI and the openai SDK
use it)."""

from __future__ import annotations

from fastapi import Depends, Request
from starlette.responses import JSONResponse

from serve_app.errors import ServiceError
from serve_app.ingress import streaming
from serve_app.ingress.auth import check_api_key
from serve_app.ingress.context import IngressContext, get_ctx, replica_headers
from serve_app.ingress.envelope import api_router, responses_envelope
from serve_app.ingress.responses.api import RESPONSES, owned_by

router = api_router(responses_envelope)


@router.post("/v1/responses")
async def create_response(request: Request, ctx: IngressContext = Depends(get_ctx)):
    return await streaming.generate(RESPONSES, request, ctx)


def _not_found(response_id: str) -> ServiceError:
    return ServiceError("not_found", f"response {response_id!r} not found (unknown, expired or not stored)",
                        param="response_id")


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, ctx: IngressContext = Depends(get_ctx)):
    tenant = check_api_key(request.headers, ctx.settings.ingress.api_keys)
    store = ctx.response_store
    record = await store.get(response_id) if store is not None else None
    if record is None or not owned_by(record, tenant):
        raise _not_found(response_id)
    return JSONResponse(record["response"], headers=replica_headers(ctx))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request, ctx: IngressContext = Depends(get_ctx)):
    tenant = check_api_key(request.headers, ctx.settings.ingress.api_keys)
    store = ctx.response_store
    record = await store.get(response_id) if store is not None else None
    # Records never change once stored, so the owner read here is the one deleted below.
    if record is None or not owned_by(record, tenant) or not await store.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True},
                        headers=replica_headers(ctx))
