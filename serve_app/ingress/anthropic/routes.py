"""POST /v1/messages, POST /v1/messages/count_tokens (any query string, e.g. `?beta=true`), HEAD /."""

from __future__ import annotations

from fastapi import Depends, Request
from starlette.responses import JSONResponse, Response

from serve_app.ingress import streaming
from serve_app.ingress.anthropic.api import MESSAGES, request_id
from serve_app.ingress.anthropic.convert import count_tokens_request, to_conversation
from serve_app.ingress.context import IngressContext, get_ctx
from serve_app.ingress.envelope import anthropic_envelope, api_router

router = api_router(anthropic_envelope)


@router.head("/")
async def head_root() -> Response:
    # Claude Code's preconnect (A0.1): any status works, 200 is the friendliest.
    return Response(status_code=200)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, ctx: IngressContext = Depends(get_ctx)):
    rid = request_id(request)
    req = count_tokens_request(await streaming.read_body(request, ctx))
    conv, opts = to_conversation(req, ctx.tenant_secret(), request.headers)
    n = await ctx.service.count_tokens(conv, opts, req.model)
    return JSONResponse({"input_tokens": n}, headers={"request-id": rid})


@router.post("/v1/messages")
async def create_message(request: Request, ctx: IngressContext = Depends(get_ctx)):
    request_id(request)
    return await streaming.generate(MESSAGES, request, ctx)
