"""OpenAI Responses as an ApiAdapter (ingress/streaming.py), with the store behind `previous_response_id`."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from serve_app import tenants
from serve_app.conversation import Event, Finish
from serve_app.errors import PromptTooLong, ServiceError
from serve_app.ingress import sse
from serve_app.ingress.context import IngressContext, RecordStore
from serve_app.ingress.responses.convert import (
    custom_tool_names,
    echo_fields,
    parse_responses_request,
    responses_to_conversation,
)
from serve_app.ingress.responses.encode import ResponsesEncoder, error_code, fold, new_id
from serve_app.ingress.responses.reasoning_crypto import ReasoningSealer
from serve_app.ingress.streaming import AdapterDefaults, Call, until_finished
from serve_app.keyring import KeyRing, keys_of
from serve_app.protocols.responses import INPUT_ITEMS, ResponsesRequest

log = logging.getLogger(__name__)

KEEPALIVE = b": keep-alive\n\n"
# Refusals a streaming client gets in-protocol (`response.failed`: `rate_limit_exceeded`, which Codex retries after
# the delay in the message, and `server_is_overloaded`, its ServerOverloaded), not as HTTP; and a prompt too long
# for the context, whose `context_length_exceeded` in `response.failed` is the only form Codex reads as "context
# window exceeded" (and compacts on): an HTTP 400 is a plain invalid request to it (codex-api `api_bridge.rs`).
# Everything else raised before generation is an HTTP error in the OpenAI envelope, as the API answers it.
STREAMED_FAILURES = ("rate_limit", "overloaded")


def sealer(secret: bytes) -> ReasoningSealer:
    """One per key ring (a tenant's, keyring.for_tenant): its keys are derived once. Cached by the whole ring, not
    the ring's bytes (its newest key alone): the Router's ring shares its newest key with the default tenant's."""
    return _sealer(keys_of(secret))


@functools.lru_cache(maxsize=256)
def _sealer(keys: tuple[bytes, ...]) -> ReasoningSealer:
    return ReasoningSealer(KeyRing(keys))


@dataclass
class ResponsesCall:
    request: ResponsesRequest
    history: list[dict[str, Any]]  # the stored items of the previous_response_id chain, as stored
    tenant: str = tenants.DEFAULT  # who asked: the stored response is theirs alone


def owned_by(record: dict[str, Any], tenant: str) -> bool:
    """Whether a stored record is `tenant`'s to read, continue or delete: a response is its tenant's alone, as an
    OpenAI response is its project's. A record stored before records named their tenant is anyone's (it expires
    within the store's TTL)."""
    return record.get("tenant", tenant) == tenant


class ResponsesWire:
    def __init__(self, encoder: ResponsesEncoder):
        self.encoder = encoder

    @property
    def finished(self) -> bool:
        return self.encoder.finished

    def start(self) -> bytes:
        return b"".join(self.encoder.start())

    def events(self, batch: list[Event]) -> bytes:
        return b"".join(until_finished(self.encoder.event, batch, lambda: self.encoder.finished))

    def keepalive(self) -> bytes:
        return KEEPALIVE

    def fail(self, err: ServiceError) -> bytes:
        if isinstance(err, PromptTooLong):  # outside the SDK's ResponseError enum, but what the API and Codex use
            return b"".join(self.encoder.fail("context_length_exceeded", err.responses_message, err.kind))
        code = error_code(err.kind)
        message = err.message
        if code == "rate_limit_exceeded" and err.retry_after:
            message = f"{message}. Please try again in {err.retry_after:.1f}s."  # the words Codex reads a delay from
        return b"".join(self.encoder.fail(code, message, err.kind))

    def fold(self, events: list[Event]) -> dict[str, Any]:
        response = fold(self.encoder, events)
        if response["status"] == "failed":  # not a stream: the failure is an HTTP error in the OpenAI envelope,
            err = response["error"] or {}  # with the status (and retry-after) the other APIs answer it with
            raise sse.refusal(Finish("error", error=err.get("message") or "generation failed",
                                     error_kind=self.encoder.error_kind or "api_error"))
        return response


class ResponsesApi(AdapterDefaults):
    # response.created leaves at once, before the engine is reached; refusals arrive as response.failed.
    peek_refusals = False

    async def parse(self, body: Any, request: Request, ctx: IngressContext) -> Call:
        req = parse_responses_request(body)
        ctx.service.resolve_model(req.model)
        tenant = ctx.tenant()
        history = (await _history(ctx.response_store, req.previous_response_id, tenant)
                   if req.previous_response_id else [])
        seal = sealer(ctx.tenant_secret())
        conv, opts = responses_to_conversation(req, lambda token, param: seal.open(token, param=param),
                                               INPUT_ITEMS.validate_python(history) if history else None)
        if opts.session_key is None:  # Codex sends its conversation id as a header too
            opts.session_key = request.headers.get("session_id") or request.headers.get("x-session-id")
        return Call(wire=ResponsesCall(req, history, tenant or tenants.DEFAULT), model=req.model, conversation=conv, options=opts,
                    stream=req.stream)

    def encoder(self, call: Call, request_id: str, prompt_tokens: int, ctx: IngressContext) -> ResponsesWire:
        req = call.wire.request
        return ResponsesWire(ResponsesEncoder(
            response_id=new_id("resp"),
            model=req.model,
            echo=echo_fields(req),
            custom_tools=custom_tool_names(req),
            summaries=wants_summary(req),
            seal=sealer(ctx.tenant_secret()).seal if req.wants_encrypted_reasoning() else None,
        ))

    def fails_in_stream(self, call: Call, err: ServiceError) -> bool:
        return err.kind in STREAMED_FAILURES or isinstance(err, PromptTooLong)

    async def finished(self, call: Call, encoder: ResponsesWire, ctx: IngressContext) -> None:
        """Store the response (unless `store: false`), so a follow-up that names it finds it on any replica."""
        store, req, response = ctx.response_store, call.wire.request, encoder.encoder.response
        if store is None or req.store is False:
            return
        items = [*_dump_items(req), *response["output"]]
        parent, tenant = req.previous_response_id, call.wire.tenant
        try:
            # This turn's items only, continuing the chain of the response it follows (store.py).
            if not await store.put(response["id"], {"response": response, "items": items, "tenant": tenant},
                                   parent) and parent:
                # The chain went while this answer was generated (expired, evicted, deleted): stored whole instead.
                await store.put(response["id"], {"response": response, "items": [*call.wire.history, *items],
                                                 "tenant": tenant})
        except Exception:  # the answer still goes out; only later lookups of this id will miss
            log.exception("could not store response %s", response["id"])

RESPONSES = ResponsesApi()


def wants_summary(req: ResponsesRequest) -> bool:
    """`reasoning.summary` (or its deprecated name `generate_summary`) asks for one: the reasoning then goes out
    as the summary instead of as raw text (docs/codex.md, "Reasoning")."""
    r = req.reasoning
    if r is None:
        return False
    return (r.summary or (r.model_extra or {}).get("generate_summary")) in ("auto", "concise", "detailed")


def _dump_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return [item.model_dump(exclude_none=True) for item in req.input]


async def _history(store: RecordStore | None, response_id: str, tenant: str | None) -> list[dict[str, Any]]:
    """The items of the stored conversation `response_id` ends: every record's of its chain, in order. Another
    tenant's response is not found, as an unknown one (`tenant` None: routing only, no owner to check)."""
    records = await store.chain(response_id) if store is not None else None
    if records is None or (tenant is not None and not owned_by(records[-1], tenant)):
        raise ServiceError("not_found", f"previous_response_id: no stored response with id {response_id!r}",
                           param="previous_response_id", code="previous_response_not_found")
    return [item for record in records for item in record["items"]]
