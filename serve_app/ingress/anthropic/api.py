"""Anthropic Messages as an ApiAdapter (ingress/streaming.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from serve_app.conversation import Event
from serve_app.errors import ServiceError
from serve_app.ingress.anthropic.convert import (
    eager_tools,
    messages_request,
    prewarming,
    thinking_omitted,
    to_conversation,
)
from serve_app.ingress.anthropic.encode import MessageEncoder, error_event, fold, to_frames
from serve_app.ingress.anthropic.errors import new_request_id
from serve_app.ingress.context import IngressContext
from serve_app.ingress.streaming import AdapterDefaults, Call, until_finished
from serve_app.protocols.anthropic import MessagesRequest


def request_id(request: Request) -> str:
    """The id that names this request in its answer, headers and any error (anthropic_envelope reads it)."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        rid = request.state.request_id = new_request_id()
    return rid


@dataclass(frozen=True, slots=True)
class MessagesCall:
    """What the encoder needs of a request: the request, and the tools whose input streams as generated (from the
    request's headers too)."""

    request: MessagesRequest
    eager_tools: frozenset[str] | None


class MessagesWire:
    def __init__(self, encoder: MessageEncoder):
        self.encoder = encoder

    @property
    def finished(self) -> bool:
        return self.encoder.done

    def start(self) -> bytes:
        return b""  # message_start goes out with the first event, which carries the prompt's usage

    def events(self, batch: list[Event]) -> bytes:
        out = until_finished(self.encoder.event, batch, lambda: self.encoder.done)
        return to_frames(out) if out else b""

    def keepalive(self) -> bytes:
        return to_frames(self.encoder.ping())

    def fail(self, err: ServiceError) -> bytes:
        self.encoder.done = True
        return to_frames([error_event(err.kind, err.message)])

    def fold(self, events: list[Event]) -> dict[str, Any]:
        return fold([se for ev in events for se in self.encoder.event(ev)])


class MessagesApi(AdapterDefaults):
    async def parse(self, body: Any, request: Request, ctx: IngressContext) -> Call:
        req = messages_request(body)
        conv, opts = to_conversation(req, ctx.tenant_secret(), request.headers)
        return Call(wire=MessagesCall(req, eager_tools(req, request.headers)), model=req.model, conversation=conv,
                    options=opts, stream=bool(req.stream))

    def encoder(self, call: Call, request_id: str, prompt_tokens: int, ctx: IngressContext) -> MessagesWire:
        req = call.wire.request
        return MessagesWire(MessageEncoder(req.model, "msg_" + request_id, thinking=bool(call.options.thinking),
                                           secret=ctx.tenant_secret(), prompt_tokens=prompt_tokens, prewarm=prewarming(req),
                                           omit_thinking=thinking_omitted(req), eager_tools=call.wire.eager_tools))

    def headers(self, request: Request, ctx: IngressContext) -> dict[str, str]:
        return {"request-id": request_id(request)}


MESSAGES = MessagesApi()
