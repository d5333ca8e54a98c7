"""POST /v1/messages, POST /v1/messages/count_tokens (any query string, e.g. `?beta=true`), HEAD /."""

from __future__ import annotations

from fastapi import Depends, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from serve_app.ingress import sse
from serve_app.ingress.anthropic.convert import count_tokens_request, messages_request, to_conversation
from serve_app.ingress.anthropic.encode import MessageEncoder, error_event, fold, to_frames
from serve_app.ingress.anthropic.errors import new_request_id
from serve_app.ingress.auth import check_api_key
from serve_app.ingress.body import read_json
from serve_app.ingress.context import IngressContext, get_ctx
from serve_app.ingress.envelope import anthropic_envelope, api_router

router = api_router(anthropic_envelope)


@router.head("/")
async def head_root() -> Response:
    # Claude Code's preconnect (A0.1): any status works, 200 is the friendliest.
    return Response(status_code=200)


async def _read(request: Request, ctx: IngressContext) -> dict:
    # One id names the request in its answer and in any error (anthropic_envelope reads it from here).
    request.state.request_id = new_request_id()
    ing = ctx.settings.ingress
    check_api_key(request.headers, ing.api_keys)
    return await read_json(request, ing.max_body_bytes, ing.max_decompressed_bytes)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, ctx: IngressContext = Depends(get_ctx)):
    body = await _read(request, ctx)
    req = count_tokens_request(body)
    conv, opts = to_conversation(req, ctx.secret, request.headers)
    n = await ctx.service.count_tokens(conv, opts, req.model)
    return JSONResponse({"input_tokens": n}, headers={"request-id": request.state.request_id})


@router.post("/v1/messages")
async def create_message(request: Request, ctx: IngressContext = Depends(get_ctx)):
    body = await _read(request, ctx)
    rid = request.state.request_id
    req = messages_request(body)
    conv, opts = to_conversation(req, ctx.secret, request.headers)
    prepared = await ctx.service.prepare(conv, opts, req.model)

    encoder = MessageEncoder(
        req.model,
        "msg_" + prepared.request_id,
        thinking=bool(opts.thinking),
        secret=ctx.secret,
        prompt_tokens=prepared.num_prompt_tokens,
    )

    if not req.stream:
        events = await ctx.service.complete(prepared)
        message = fold([se for ev in events for se in encoder.event(ev)])
        return JSONResponse(message, headers={"request-id": rid})

    stream = sse.with_keepalive(ctx.service.stream(prepared), ctx.settings.ingress.ping_interval_s)
    first, stream = await sse.peek(stream)
    refused = sse.refusal(first)
    if refused is not None:
        await stream.aclose()
        raise refused

    async def frames():
        try:
            # Each event leaves as produced; events that piled up while the route lagged leave in one write.
            async for batch in sse.batches(stream):
                out = []
                for ev in batch:
                    out += encoder.ping() if ev is None else encoder.event(ev)
                    if encoder.done:
                        break
                if out:
                    yield to_frames(out)
                if encoder.done:
                    break
            if not encoder.done:  # the service always ends with Finish; never leave a client hanging if not
                yield to_frames([error_event("api_error", "the generation ended without finishing")])
        finally:
            await stream.aclose()

    return StreamingResponse(
        frames(), media_type="text/event-stream", headers={**sse.SSE_HEADERS, "request-id": rid}
    )
