"""Semantic events → Anthropic Messages stream events, and the non-streaming message as that stream folded.

`MessageEncoder` is the one place the block lifecycle lives (harness-contracts A6): `message_start` once and first;
a new content block per segment (thinking, text, tool_use) so interleaved output opens new blocks and never writes
to a closed one; one `signature_delta` closing each thinking block; `message_delta` with the mapped stop reason and
cumulative usage; `message_stop` last. `fold` applies those same events the way a client's accumulator does, so the
non-streaming body cannot disagree with the stream.
"""

from __future__ import annotations

import json
import logging
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
from serve_app.ingress.anthropic.convert import wire_tool_id
from serve_app.ingress.anthropic.errors import ERROR_TYPES, error_body
from serve_app.ingress.anthropic.signatures import ThinkingSealer, ThinkingSigner

log = logging.getLogger(__name__)

StreamEvent = tuple[str, dict[str, Any]]  # (SSE event name, data)

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    # The service's own cap stopped a longer answer the client allowed: the turn is paused, and sending it back
    # as-is continues it (the last assistant message is continued). `max_tokens` would read as the client's own
    # limit: Claude Code then reports "exceeded the 32000 output token maximum" (docs/limits.md).
    "output_cap": "pause_turn",
    "context_window": "model_context_window_exceeded",  # the context filled before max_tokens (docs/limits.md)
    "tool_calls": "tool_use",
    "stop_sequence": "stop_sequence",
    "abort": "end_turn",
}

PING: StreamEvent = ("ping", {"type": "ping"})


def usage_dict(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    """Anthropic semantics (A8): `input_tokens` is the uncached part; the whole prompt is input + cache_read."""
    cached = max(0, min(cached_tokens, prompt_tokens))
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


class MessageEncoder:
    def __init__(self, model: str, message_id: str, *, thinking: bool, secret: bytes, prompt_tokens: int = 0,
                 prewarm: bool = False, omit_thinking: bool = False, eager_tools: frozenset[str] | None = None):
        self.model = model
        # The tools whose calls stream as generated (None: all; convert.eager_tools). Any other call is held
        # until it ends and then goes out whole: a call the parser abandons (cut off, or malformed mid-stream) is
        # never sent, so the stream folds to exactly the non-streaming message, as the API validates such input
        # before streaming it. Sent, a half call would be run by the client with whatever input it had.
        self._held = None if eager_tools is None else HeldCalls(lambda name: name not in eager_tools)
        self.omit_thinking = omit_thinking  # `display: "omitted"`: no thinking text, a signature that seals it
        # `max_tokens: 0`: the engine prefills the prompt and makes one token (it cannot make none), which the
        # answer does not show: no content, no output tokens, stopped by max_tokens.
        self.prewarm = prewarm
        self.message_id = message_id
        self.thinking = thinking
        self.secret = secret
        self._prompt_tokens = prompt_tokens  # fallback if something must be said before the first Usage
        self.started = False
        self.done = False
        self._index = -1  # index of the last opened block
        self._open: str | None = None  # "thinking" | "text" | "tool_use" | None
        self._open_call: int | None = None  # parser call index of the open tool_use block
        self._signer: ThinkingSigner | ThinkingSealer | None = None
        self._held_ws = ""  # leading whitespace of a text segment not yet known to be non-empty
        self._final: Usage | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------

    def _start(self, usage: Usage | None) -> list[StreamEvent]:
        self.started = True
        if usage is not None:
            u = usage_dict(usage.prompt_tokens, usage.cached_tokens, 0)
        else:
            u = usage_dict(self._prompt_tokens, 0, 0)
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": u,
        }
        # A ping right behind message_start, as the API sends one: clients that time out on silence see the
        # stream alive before a long prefill, without waiting for the first keep-alive interval.
        return [("message_start", {"type": "message_start", "message": message}), PING]

    def _ensure_started(self, out: list[StreamEvent]) -> None:
        if not self.started:
            out.extend(self._start(None))

    def _close(self, out: list[StreamEvent]) -> None:
        if self._open is None:
            self._held_ws = ""
            return
        if self._open == "thinking" and self._signer is not None:
            out.append(self._delta({"type": "signature_delta", "signature": self._signer.signature()}))
            self._signer = None
        out.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._open = None
        self._open_call = None
        self._held_ws = ""

    def _open_block(self, out: list[StreamEvent], kind: str, block: dict[str, Any]) -> None:
        self._close(out)
        self._index += 1
        self._open = kind
        out.append(("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block}))

    def _delta(self, delta: dict[str, Any]) -> StreamEvent:
        return ("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})

    # -- events --------------------------------------------------------------------------------------------

    def ping(self) -> list[StreamEvent]:
        if not self.started:
            return self._start(None)  # message_start, then its ping
        return [PING]

    def event(self, ev: Event) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self.done:
            return out
        if isinstance(ev, Usage):
            if not self.started:
                return self._start(ev)
            if not ev.estimated:
                self._final = ev
            return out
        self._ensure_started(out)
        if self.prewarm and not isinstance(ev, Finish):
            return out
        if self._held is not None:
            for now in self._held.push(ev):
                self._event(now, out)
            return out
        self._event(ev, out)
        return out

    def _event(self, ev: Event, out: list[StreamEvent]) -> None:
        if isinstance(ev, TextDelta):
            self._text(out, ev.text)
        elif isinstance(ev, ReasoningDelta):
            # Thinking off: reasoning is dropped, never turned into text (the client asked for no thinking).
            if self.thinking and ev.text:
                if self._open != "thinking":
                    self._open_block(out, "thinking", {"type": "thinking", "thinking": "", "signature": ""})
                    self._signer = (ThinkingSealer if self.omit_thinking else ThinkingSigner)(self.secret)
                assert self._signer is not None
                self._signer.update(ev.text)
                if not self.omit_thinking:
                    out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
        elif isinstance(ev, ToolCallStart):
            block = {"type": "tool_use", "id": wire_tool_id(ev.id), "name": ev.name, "input": {}}
            self._open_block(out, "tool_use", block)
            self._open_call = ev.index
        elif isinstance(ev, ToolCallArgsDelta):
            if ev.arguments:
                if self._open == "tool_use" and self._open_call == ev.index:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": ev.arguments}))
                else:  # the parsers emit calls one after another; a closed block is never written to
                    log.warning("dropped arguments for tool call %d: its block is not open", ev.index)
        elif isinstance(ev, ToolCallEnd):
            if self._open == "tool_use" and self._open_call == ev.index:
                self._close(out)
        elif isinstance(ev, Finish):
            out.extend(self._finish(ev))

    def _text(self, out: list[StreamEvent], text: str) -> None:
        if not text:
            return
        if self._open != "text":
            # No empty or whitespace-only text blocks (A6.12; the API refuses them when sent back): hold leading
            # whitespace until the segment shows real text.
            if not text.strip():
                if self._open is not None:
                    self._close(out)
                self._held_ws += text
                return
            held, self._held_ws = self._held_ws, ""
            self._open_block(out, "text", {"type": "text", "text": ""})
            text = held + text
        out.append(self._delta({"type": "text_delta", "text": text}))

    def _finish(self, fin: Finish) -> list[StreamEvent]:
        self.done = True
        if fin.reason == "error":
            # After the 200 went out, the API reports failures in-stream; the SDK raises it as that error type.
            return [error_event(fin.error_kind, fin.error or "engine error")]
        out: list[StreamEvent] = []
        self._close(out)
        u = self._final
        usage = usage_dict(u.prompt_tokens, u.cached_tokens, 0 if self.prewarm else u.completion_tokens) if u else (
            usage_dict(self._prompt_tokens, 0, 0))
        usage.pop("cache_creation")
        usage.pop("service_tier")
        stop_reason = "max_tokens" if self.prewarm else STOP_REASONS.get(fin.reason, "end_turn")
        out.append(
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": stop_reason,
                        "stop_sequence": fin.stop_sequence if stop_reason == "stop_sequence" else None,
                    },
                    "usage": usage,
                },
            )
        )
        out.append(("message_stop", {"type": "message_stop"}))
        return out


def error_event(kind: str | None, message: str) -> StreamEvent:
    return ("error", error_body(kind, message))


_DELTA_FIELD = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
_dumps = sse.compact_json


def _frame(name: str, data: dict[str, Any]) -> bytes:
    if name == "content_block_delta":
        # The per-token hot path: format the fixed envelope and encode only the delta's string.
        delta = data["delta"]
        field = _DELTA_FIELD.get(delta["type"])
        if field is not None:
            return (
                f'event: content_block_delta\ndata: {{"type":"content_block_delta","index":{data["index"]},'
                f'"delta":{{"type":"{delta["type"]}","{field}":{_dumps(delta[field])}}}}}\n\n'
            ).encode()
    return sse.frame(data, name)


def to_frames(events: list[StreamEvent]) -> bytes:
    if len(events) == 1:
        return _frame(*events[0])
    return b"".join(_frame(name, data) for name, data in events)


def fold(events: list[StreamEvent]) -> dict[str, Any]:
    """The final message, built from the stream events the way a client's accumulator builds it."""
    message: dict[str, Any] | None = None
    json_bufs: dict[int, list[str]] = {}
    text_bufs: dict[int, list[str]] = {}
    for name, data in events:
        if name == "error":
            err = data["error"]
            kind = next((k for k, v in ERROR_TYPES.items() if v == err["type"]), "api_error")
            raise ServiceError(kind, err["message"])  # type: ignore[arg-type]
        if name == "message_start":
            message = dict(data["message"])
            message["content"] = []
            message["usage"] = dict(message["usage"])
        elif message is None:
            continue
        elif name == "content_block_start":
            message["content"].append(dict(data["content_block"]))
            text_bufs[data["index"]] = []
        elif name == "content_block_delta":
            i, d = data["index"], data["delta"]
            block = message["content"][i]
            if d["type"] == "text_delta":
                text_bufs[i].append(d["text"])
            elif d["type"] == "thinking_delta":
                text_bufs[i].append(d["thinking"])
            elif d["type"] == "signature_delta":
                block["signature"] = d["signature"]
            elif d["type"] == "input_json_delta":
                json_bufs.setdefault(i, []).append(d["partial_json"])
        elif name == "content_block_stop":
            i = data["index"]
            block = message["content"][i]
            if block["type"] == "text":
                block["text"] = "".join(text_bufs.pop(i, []))
            elif block["type"] == "thinking":
                block["thinking"] = "".join(text_bufs.pop(i, []))
            elif block["type"] == "tool_use":
                raw = "".join(json_bufs.pop(i, []))
                try:
                    block["input"] = json.loads(raw) if raw else {}
                except ValueError:
                    block["input"] = {}
        elif name == "message_delta":
            message["stop_reason"] = data["delta"]["stop_reason"]
            message["stop_sequence"] = data["delta"]["stop_sequence"]
            message["usage"].update(data["usage"])
    if message is None:
        raise ServiceError("api_error", "the generation ended before it started")
    return message

