"""Chat Completions as an ApiAdapter (ingress/streaming.py)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from serve_app.conversation import Event, Finish
from serve_app.errors import ServiceError
from serve_app.ingress.chat.convert import chat_request_to_conversation
from serve_app.ingress.chat.encode import ChatStreamEncoder, completion_body
from serve_app.ingress.context import IngressContext
from serve_app.ingress.streaming import AdapterDefaults, Call, until_finished

KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it


class ChatWire:
    def __init__(self, model: str, request_id: str, *, include_usage: bool, dispatch: bool, hold_calls: bool):
        self.model, self.request_id = model, request_id
        self.encoder = ChatStreamEncoder(model, request_id, include_usage=include_usage, dispatch=dispatch,
                                         hold_calls=hold_calls)
        self.finished = False

    def start(self) -> bytes:
        return self.encoder.start()

    def events(self, batch: list[Event]) -> bytes:
        return b"".join(until_finished(self._event, batch, lambda: self.finished))

    def _event(self, ev: Event) -> list[bytes]:
        self.finished = self.finished or isinstance(ev, Finish)
        return self.encoder.event(ev)

    def keepalive(self) -> bytes:
        return KEEPALIVE

    def fail(self, err: ServiceError) -> bytes:
        self.finished = True
        return b"".join(self.encoder.error(err))

    def fold(self, events: list[Event]) -> dict[str, Any]:
        return completion_body(self.model, self.request_id, events)


class ChatApi(AdapterDefaults):
    async def parse(self, body: Any, request: Request, ctx: IngressContext) -> Call:
        req, conv, opts = chat_request_to_conversation(body)
        return Call(wire=req, model=req.model, conversation=conv, options=opts, stream=bool(req.stream))

    def encoder(self, call: Call, request_id: str, prompt_tokens: int, ctx: IngressContext) -> ChatWire:
        req = call.wire
        hold = req.nvext.hold_tool_calls if req.nvext is not None else None
        if hold is None:
            hold = ctx.settings.ingress.chat_tool_calls == "hold"
        return ChatWire(req.model, request_id,
                        include_usage=bool(req.stream_options and req.stream_options.include_usage),
                        # Only to a client that asks: the OpenAI SDK turns a named SSE event into a bogus chunk
                        # (`choices` None), which breaks ordinary streaming code.
                        dispatch=ctx.settings.ingress.tool_dispatch and bool(req.nvext and req.nvext.tool_dispatch),
                        hold_calls=hold)


CHAT = ChatApi()
