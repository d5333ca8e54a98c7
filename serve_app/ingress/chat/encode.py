"""Semantic events → Chat Completions chunks (streaming), and the completion object as that stream folded.

With tool dispatch on, each tool call is also announced on an SSE side channel (`event: tool_call_dispatch`)
the moment its arguments are complete, so a harness can start running it before the turn ends.
"""

from __future__ import annotations

import json
import time
from typing import Any

from serve_app.conversation import (
    Event,
    Finish,
    HeldCalls,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from serve_app.errors import ServiceError
from serve_app.ingress import sse
from serve_app.ingress.openai_errors import error_body

# Chat has one reason for every token limit, the client's or the context's (docs/limits.md).
FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "output_cap": "length",
          "context_window": "length", "tool_calls": "tool_calls", "abort": "stop"}

def usage_dict(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


class ChatStreamEncoder:
    def __init__(self, model: str, request_id: str, *, include_usage: bool = False, dispatch: bool = False,
                 hold_calls: bool = False):
        self.id = f"chatcmpl-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.dispatch = dispatch
        self._calls: dict[int, dict[str, Any]] = {}  # only filled when dispatching: the full arguments are needed
        # Held: each call goes out whole at its end (its id and name, then all its arguments in one chunk) and one the
        # parser abandons never goes out, so the stream folds to exactly the non-streaming message.
        if hold_calls:  # chosen once here: `event` runs once per token, unheld streams pay nothing for this
            self._held = HeldCalls()
            self.event = self._held_event
        self._usage: Usage | None = None
        self._head: str | None = None
        self._tail = ""

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        # Byte for byte what json.dumps of the whole chunk gives, with everything but the delta encoded once per
        # stream: a chunk per token is the hottest path in the ingress.
        if self._head is None:
            dumps = _compact
            self._head = ('data: {"id":' + dumps(self.id) + ',"object":"chat.completion.chunk","created":'
                          + str(self.created) + ',"model":' + dumps(self.model)
                          + ',"choices":[{"index":0,"delta":')
            self._tail = "}]" + (',"usage":null' if self.include_usage else "") + "}\n\n"
        return (self._head + _compact(delta) + ',"logprobs":null,"finish_reason":'
                + ("null" if finish is None else _compact(finish)) + self._tail).encode()

    def _text_chunk(self, key: str, text: str) -> bytes:
        # `_chunk({key: text})` without building the dict and a JSON encoder run: one per streamed token.
        if self._head is None:
            return self._chunk({key: text})
        return (self._head + '{"' + key + '":' + _string(text) + '},"logprobs":null,"finish_reason":null'
                + self._tail).encode()

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def _held_event(self, ev: Event) -> list[bytes]:
        return [frame for now in self._held.push(ev) for frame in type(self).event(self, now)]

    def event(self, ev: Event) -> list[bytes]:
        if isinstance(ev, TextDelta):
            return [self._text_chunk("content", ev.text)] if ev.text else []
        if isinstance(ev, ReasoningDelta):
            return [self._text_chunk("reasoning_content", ev.text)] if ev.text else []
        if isinstance(ev, ToolCallStart):
            if self.dispatch:
                self._calls[ev.index] = {"id": ev.id, "name": ev.name, "args": []}
            return [self._chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                                  "function": {"name": ev.name, "arguments": ""}}]})]
        if isinstance(ev, ToolCallArgsDelta):
            if self.dispatch and ev.index in self._calls:
                self._calls[ev.index]["args"].append(ev.arguments)
            if not ev.arguments:
                return []
            return [self._chunk({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.arguments}}]})]
        if isinstance(ev, ToolCallEnd):
            call = self._calls.pop(ev.index, None) if self.dispatch else None
            if call is None:
                return []
            payload = {
                "choice_index": 0,
                "tool_call": {"index": ev.index, "id": call["id"], "type": "function",
                              "function": {"name": call["name"], "arguments": "".join(call["args"])}},
            }
            return [sse.frame(payload, event="tool_call_dispatch")]
        if isinstance(ev, Usage):
            if not ev.estimated:
                self._usage = ev
            return []
        if isinstance(ev, Finish):
            if ev.reason == "error":
                return self.error(sse.finish_error(ev))
            out = [self._chunk({}, FINISH.get(ev.reason, "stop"))]
            if self.include_usage and self._usage is not None:
                out.append(self._usage_chunk(self._usage))
            out.append(sse.DONE)
            return out
        return []

    def _usage_chunk(self, usage: Usage) -> bytes:
        return sse.frame({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                          "model": self.model, "choices": [], "usage": usage_dict(usage)})

    def error(self, err: ServiceError) -> list[bytes]:
        """The stream's end for a failure: the OpenAI error object as a data frame, then [DONE]. Its type and code
        are the ones the same failure gets as an HTTP answer (overload: `server_is_overloaded`)."""
        return [sse.frame(error_body(err.kind, err.message, err.param, err.code)), sse.DONE]


class _Fold(ChatStreamEncoder):
    """The encoder with each chunk applied to one message, as a client's accumulator applies it, instead of framed."""

    def __init__(self, model: str, request_id: str):
        super().__init__(model, request_id, include_usage=True)
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason = "stop"
        self.usage = Usage(0, 0)

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        if "content" in delta and "role" not in delta:  # the opening chunk's empty content is not content
            self.content.append(delta["content"])
        if "reasoning_content" in delta:
            self.reasoning.append(delta["reasoning_content"])
        for tc in delta.get("tool_calls", ()):
            call = self.calls.setdefault(tc["index"], {"id": tc.get("id"), "name": None, "arguments": []})
            call["name"] = tc["function"].get("name") or call["name"]
            call["arguments"].append(tc["function"].get("arguments", ""))
        if finish is not None:
            self.finish_reason = finish
        return b""

    def _usage_chunk(self, usage: Usage) -> bytes:
        self.usage = usage
        return b""

    def error(self, err: ServiceError) -> list[bytes]:
        raise err

    def body(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant",
                                   "content": "".join(self.content) if self.content or not self.calls else None}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": "".join(c["arguments"])}}
                for _, c in sorted(self.calls.items())
            ]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish_reason}],
            "usage": usage_dict(self.usage),
        }


def completion_body(model: str, request_id: str, events: list[Event]) -> dict[str, Any]:
    """The non-streaming response: the stream's own chunks folded into one message (so the two cannot disagree).
    A failed generation raises its ServiceError."""
    fold = _Fold(model, request_id)
    fold.start()
    for ev in events:
        fold.event(ev)
    return fold.body()


_compact = sse.compact_json
_string = json.encoder.encode_basestring  # a str as json.dumps(ensure_ascii=False) writes it (the C encoder)
_spaced = json.JSONEncoder(ensure_ascii=False).encode  # one encoder, as sse.compact_json


def dumps(obj: Any) -> str:
    return _spaced(obj)
