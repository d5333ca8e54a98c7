"""POST /v1/responses and GET /v1/responses/{id} (OpenAI Responses API, as Codex CLI and the openai SDK use it)."""

from __future__ import annotations

import functools
import logging
from typing import Any

from fastapi import Depends, Request
from starlette.responses import JSONResponse, StreamingResponse

from serve_app.errors import ServiceError
from serve_app.ingress import sse
from serve_app.ingress.auth import check_api_key
from serve_app.ingress.body import read_json
from serve_app.ingress.context import IngressContext, RecordStore, get_ctx
from serve_app.ingress.envelope import api_router, openai_envelope
from serve_app.ingress.responses.convert import (
    custom_tool_names,
    echo_fields,
    parse_responses_request,
    responses_to_conversation,
)
from serve_app.ingress.responses.encode import ResponsesEncoder, error_code, fold, new_id
from serve_app.ingress.responses.reasoning_crypto import ReasoningSealer
from serve_app.protocols.responses import INPUT_ITEMS, ResponsesRequest

log = logging.getLogger(__name__)
router = api_router(openai_envelope)

# Failures a streaming client should get in-protocol (`response.failed` with a code Codex acts on), not as HTTP.
_STREAMED_FAILURES = ("context_length_exceeded", "rate_limit_exceeded", "server_is_overloaded")


def _replica_headers(ctx: IngressContext) -> dict[str, str]:
    """`x-serve-replica`: which ingress replica answered (lets tests and operators see cross-replica use)."""
    return {"x-serve-replica": ctx.replica_tag} if ctx.replica_tag else {}


@functools.lru_cache(maxsize=4)
def _sealer(secret: bytes) -> ReasoningSealer:
    return ReasoningSealer(secret)  # one per server secret: its key is derived once


def _dump_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return [item.model_dump(exclude_none=True) for item in req.input]


async def _history(store: RecordStore | None, response_id: str) -> list[dict[str, Any]]:
    record = await store.get(response_id) if store is not None else None
    if record is None:
        raise ServiceError("not_found", f"previous_response_id: no stored response with id {response_id!r}",
                           param="previous_response_id", code="previous_response_not_found")
    return record["items"]


async def _save(store: RecordStore | None, req: ResponsesRequest, history: list[dict[str, Any]],
                response: dict[str, Any]) -> None:
    if store is None or req.store is False:
        return
    record = {"response": response, "items": [*history, *_dump_items(req), *response["output"]]}
    try:
        await store.put(response["id"], record)
    except Exception:  # the answer still goes out; only later lookups of this id will miss
        log.exception("could not store response %s", response["id"])


@router.post("/v1/responses")
async def create_response(request: Request, ctx: IngressContext = Depends(get_ctx)):
    ing = ctx.settings.ingress
    check_api_key(request.headers, ing.api_keys)
    body = await read_json(request, ing.max_body_bytes, ing.max_decompressed_bytes)
    req = parse_responses_request(body)
    ctx.service.resolve_model(req.model)
    sealer = _sealer(ctx.secret)
    store = ctx.response_store

    history_raw: list[dict[str, Any]] = []
    if req.previous_response_id:
        history_raw = await _history(store, req.previous_response_id)
    history = INPUT_ITEMS.validate_python(history_raw) if history_raw else None
    conv, opts = responses_to_conversation(req, lambda token, param: sealer.open(token, param=param), history)
    if opts.session_key is None:  # Codex sends its conversation id as a header too
        opts.session_key = request.headers.get("session_id") or request.headers.get("x-session-id")

    summaries = bool(req.reasoning and req.reasoning.summary and req.reasoning.summary != "none")
    encoder = ResponsesEncoder(
        response_id=new_id("resp"),
        model=req.model,
        echo=echo_fields(req),
        custom_tools=custom_tool_names(req),
        summaries=summaries,
        seal=sealer.seal if req.wants_encrypted_reasoning() else None,
    )

    try:
        prepared = await ctx.service.prepare(conv, opts, req.model)
    except ServiceError as e:
        code = error_code(e.kind, e.code)
        if not req.stream or code not in _STREAMED_FAILURES:
            raise
        message = e.message
        if code == "rate_limit_exceeded" and e.retry_after:
            message = f"{message}. Please try again in {e.retry_after:.1f}s."

        async def failed():
            for chunk in encoder.start():
                yield chunk
            for chunk in encoder.fail(code, message):
                yield chunk

        return StreamingResponse(failed(), media_type="text/event-stream",
                                 headers={**sse.SSE_HEADERS, **_replica_headers(ctx)})

    if not req.stream:
        response = fold(encoder, await ctx.service.complete(prepared))
        if response["status"] == "failed":
            err = response["error"] or {}
            raise ServiceError("overloaded" if err.get("code") == "server_is_overloaded" else "api_error",
                               err.get("message") or "generation failed", code=err.get("code"))
        await _save(store, req, history_raw, response)
        return JSONResponse(response, headers=_replica_headers(ctx))

    async def frames():
        for chunk in encoder.start():  # response.created leaves at once: no batching in front of the first token
            yield chunk
        stream = sse.with_keepalive(ctx.service.stream(prepared), ing.ping_interval_s)
        try:
            # Each event leaves as produced; events that piled up while the route lagged leave in one write.
            async for batch in sse.batches(stream):
                if batch == [None]:
                    yield b": keep-alive\n\n"
                    continue
                out = [chunk for ev in batch for chunk in encoder.event(ev)]
                if encoder.finished:
                    # Stored before the terminal event leaves, so a follow-up that names it always finds it.
                    await _save(store, req, history_raw, encoder.response)
                if out:
                    yield b"".join(out)
            if not encoder.finished:
                for chunk in encoder.fail("server_error", "the generation stream ended without finishing"):
                    yield chunk
        finally:
            await stream.aclose()

    return StreamingResponse(frames(), media_type="text/event-stream",
                             headers={**sse.SSE_HEADERS, **_replica_headers(ctx)})


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, ctx: IngressContext = Depends(get_ctx)):
    check_api_key(request.headers, ctx.settings.ingress.api_keys)
    store = ctx.response_store
    record = await store.get(response_id) if store is not None else None
    if record is None:
        raise ServiceError("not_found", f"response {response_id!r} not found (unknown, expired or not stored)",
                           param="response_id")
    return JSONResponse(record["response"], headers=_replica_headers(ctx))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request, ctx: IngressContext = Depends(get_ctx)):
    check_api_key(request.headers, ctx.settings.ingress.api_keys)
    store = ctx.response_store
    if store is None or not await store.delete(response_id):
        raise ServiceError("not_found", f"response {response_id!r} not found (unknown, expired or not stored)",
                           param="response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True},
                        headers=_replica_headers(ctx))
