"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import Depends, Request

from serve_app.ingress import streaming
from serve_app.ingress.chat.api import CHAT
from serve_app.ingress.context import IngressContext, get_ctx
from serve_app.ingress.envelope import api_router, openai_envelope

router = api_router(openai_envelope)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, ctx: IngressContext = Depends(get_ctx)):
    return await streaming.generate(CHAT, request, ctx)
