"""Semantic events → Chat Completions chunks (streaming) or one completion object (the stream folded).

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
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from serve_app.ingress import sse
from serve_app.ingress.openai_errors import error_body

FINISH = {"stop": "stop", "stop_sequence": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "stop"}

def usage_dict(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


class ChatStreamEncoder:
    def __init__(self, model: str, request_id: str, *, include_usage: bool = False, dispatch: bool = False):
        self.id = f"chatcmpl-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.dispatch = dispatch
        self._calls: dict[int, dict[str, Any]] = {}  # only filled when dispatching: the full arguments are needed
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
        return (self._head + _compact(delta) + ',"logprobs":null,"finish_reason":' + _compact(finish)
                + self._tail).encode()

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def event(self, ev: Event) -> list[bytes]:
        if isinstance(ev, TextDelta):
            return [self._chunk({"content": ev.text})] if ev.text else []
        if isinstance(ev, ReasoningDelta):
            return [self._chunk({"reasoning_content": ev.text})] if ev.text else []
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
                return [sse.frame(error_body(ev.error_kind or "api_error", ev.error or "engine error")), sse.DONE]
            out = [self._chunk({}, FINISH.get(ev.reason, "stop"))]
            if self.include_usage and self._usage is not None:
                out.append(sse.frame({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                      "model": self.model, "choices": [], "usage": usage_dict(self._usage)}))
            out.append(sse.DONE)
            return out
        return []


def completion_body(model: str, request_id: str, events: list[Event]) -> dict[str, Any]:
    """The non-streaming response: the same events folded into one message."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    usage = Usage(0, 0)
    finish = Finish("stop")
    for ev in events:
        if isinstance(ev, TextDelta):
            content.append(ev.text)
        elif isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, ToolCallStart):
            calls[ev.index] = {"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": []}}
        elif isinstance(ev, ToolCallArgsDelta):
            calls[ev.index]["function"]["arguments"].append(ev.arguments)
        elif isinstance(ev, Usage) and not ev.estimated:
            usage = ev
        elif isinstance(ev, Finish):
            finish = ev
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [
            {**c, "function": {"name": c["function"]["name"], "arguments": "".join(c["function"]["arguments"])}}
            for _, c in sorted(calls.items())
        ]
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": FINISH.get(finish.reason, "stop")}],
        "usage": usage_dict(usage),
    }


def _compact(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)
