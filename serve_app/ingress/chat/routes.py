"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import Depends, Request
from starlette.responses import JSONResponse, StreamingResponse

from serve_app.conversation import Finish
from serve_app.errors import ServiceError
from serve_app.ingress import sse
from serve_app.ingress.auth import check_api_key
from serve_app.ingress.body import read_json
from serve_app.ingress.chat.convert import chat_request_to_conversation
from serve_app.ingress.chat.encode import ChatStreamEncoder, completion_body
from serve_app.ingress.context import IngressContext, get_ctx
from serve_app.ingress.envelope import api_router, openai_envelope

router = api_router(openai_envelope)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, ctx: IngressContext = Depends(get_ctx)):
    ing = ctx.settings.ingress
    check_api_key(request.headers, ing.api_keys)
    body = await read_json(request, ing.max_body_bytes, ing.max_decompressed_bytes)
    req, conv, opts = chat_request_to_conversation(body)
    prepared = await ctx.service.prepare(conv, opts, req.model)

    if not req.stream:
        events = await ctx.service.complete(prepared)
        finish = events[-1] if events and isinstance(events[-1], Finish) else None
        if finish is not None and finish.reason == "error":
            raise ServiceError(finish.error_kind or "api_error", finish.error or "engine error")
        return JSONResponse(completion_body(req.model, prepared.request_id, events))

    encoder = ChatStreamEncoder(
        req.model,
        prepared.request_id,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        dispatch=ing.tool_dispatch,
    )

    stream = sse.with_keepalive(ctx.service.stream(prepared), ing.ping_interval_s)
    first, stream = await sse.peek(stream)
    refused = sse.refusal(first)
    if refused is not None:
        await stream.aclose()
        raise refused

    async def frames():
        yield encoder.start()
        try:
            # One write per batch: a route that keeps up sends each event as produced; one that lags sends what
            # piled up together (fewer messages through Serve's proxy), never waiting for more.
            async for batch in sse.batches(stream):
                out = [b": keep-alive\n\n"] if batch == [None] else [c for ev in batch for c in encoder.event(ev)]
                if out:
                    yield b"".join(out)
        finally:
            await stream.aclose()

    return StreamingResponse(frames(), media_type="text/event-stream", headers=sse.SSE_HEADERS)
