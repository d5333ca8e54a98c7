"""Semantic events → the Responses API event sequence (and, folded, the non-streaming response object).

One encoder instance per request. Every event carries a `sequence_number`; every output item gets one id that is
the same in `output_item.added`, its deltas, its `*.done` events, `output_item.done` and `response.completed`
(Codex and the `openai` SDK pair items by id). The sequence for each item kind:

    message    output_item.added, content_part.added, output_text.delta*, output_text.done, content_part.done,
               output_item.done
    reasoning  output_item.added, then on one channel: the summary when `reasoning.summary` asks for one
               (reasoning_summary_part.added, reasoning_summary_text.delta*, reasoning_summary_text.done,
               reasoning_summary_part.done), else the raw text (content_part.added, reasoning_text.delta*,
               reasoning_text.done, content_part.done); then output_item.done
    function   output_item.added, function_call_arguments.delta*, function_call_arguments.done, output_item.done
    custom     output_item.added, custom_tool_call_input.delta*, custom_tool_call_input.done, output_item.done

and the response: response.created, response.in_progress, items…, then exactly one of response.completed /
response.incomplete (a token limit: `incomplete_details.reason` "max_output_tokens", and the item it cut off
says `status: "incomplete"`) / response.failed (an `error.code` from the SDK's `ResponseError` enum, or one of the
two Codex reads that it lacks: CODEX_CODES).
Each reasoning token goes out once per channel the client asked for (docs/codex.md, "Reasoning"): the service has
no summarizer, so a requested summary is the reasoning itself, sent as the summary instead of as raw text, never as
both; `encrypted_content` (on `include`) seals the same text into the finished item.

Freeform (`custom`) tools are shown to the model as a function with one string parameter; the encoder turns their
calls back into `custom_tool_call` items, decoding the JSON string incrementally so the raw input streams O(Δ).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

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
from serve_app.ingress import sse

# serve_app.errors kind → `response.error.code` in `response.failed`: members of the SDK's `ResponseError.code` enum
# (tests/unit/test_responses_encode.py checks them against it), except the codes OpenAI sends and Codex acts on by
# name (codex-api `sse/responses.rs`) that the enum lacks, CODEX_CODES: overload is `server_is_overloaded` (Codex's
# ServerOverloaded, as the OpenAI envelope's 503 is), and a prompt that does not fit is `context_length_exceeded`
# (api.py; what Codex compacts on; docs/limits.md). Codex retries `server_error` with backoff and
# `rate_limit_exceeded` after the delay it reads from "try again in Ns" in the message.
ERROR_CODES = {
    "rate_limit": "rate_limit_exceeded",
    "overloaded": "server_is_overloaded",
    "invalid_request": "invalid_prompt",
    "not_found": "invalid_prompt",
    "timeout": "server_error",
    "api_error": "server_error",
}
CODEX_CODES = frozenset({"server_is_overloaded", "context_length_exceeded"})


def error_code(kind: str | None) -> str:
    return ERROR_CODES.get(kind or "api_error", "server_error")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_object(u: Usage | None) -> dict[str, Any]:
    u = u or Usage(0, 0)
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


class _JsonStringValue:
    """Streams the decoded value of the first string member of a JSON object given in fragments (O(Δ) per push).

    `{"input": "*** Begin Patch\\n..."}` → `*** Begin Patch\n...`. Escapes split across fragments are held back.
    """

    __slots__ = ("state", "pending")

    def __init__(self):
        self.state = 0  # 0 before the key, 1 in key, 2 after key (wait for the value quote), 3 in value, 4 done
        self.pending = ""  # an incomplete escape sequence at the end of the last fragment

    def push(self, frag: str) -> str:
        out: list[str] = []
        i, n = 0, len(frag)
        if self.pending:
            frag = self.pending + frag
            n = len(frag)
            self.pending = ""
        while i < n:
            c = frag[i]
            st = self.state
            if st == 0:
                if c == '"':
                    self.state = 1
            elif st == 1:
                if c == "\\":
                    i += 1  # skip the escaped char of the key
                elif c == '"':
                    self.state = 2
            elif st == 2:
                if c == '"':
                    self.state = 3
                elif c not in " \t\r\n:":
                    self.state = 4  # the value is not a string: nothing to stream, `done` carries the truth
            elif st == 3:
                j = i
                while j < n and frag[j] not in '\\"':
                    j += 1
                if j > i:
                    out.append(frag[i:j])
                if j >= n:
                    break
                if frag[j] == '"':
                    self.state = 4
                    break
                esc = frag[j:j + 2]
                if len(esc) < 2:
                    self.pending = frag[j:]
                    break
                if esc[1] == "u":
                    seq = frag[j:j + 6]
                    if len(seq) < 6:
                        self.pending = frag[j:]
                        break
                    code = int(seq[2:], 16)
                    if 0xD800 <= code < 0xDC00:  # high surrogate: needs its pair
                        pair = frag[j:j + 12]
                        if len(pair) < 12:
                            self.pending = frag[j:]
                            break
                        try:
                            out.append(json.loads(f'"{pair}"'))
                        except ValueError:
                            pass
                        i = j + 12
                        continue
                    out.append(chr(code))
                    i = j + 6
                    continue
                out.append({"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f"}.get(esc[1], esc[1]))
                i = j + 2
                continue
            else:
                break
            i += 1
        return "".join(out)


def custom_input_from_arguments(arguments: str) -> str:
    """The raw input of a freeform call from the function-style arguments the model produced."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict):
        if isinstance(value.get("input"), str):
            return value["input"]
        strings = [v for v in value.values() if isinstance(v, str)]
        if len(strings) == 1:
            return strings[0]
    if isinstance(value, str):
        return value
    return arguments


class ResponsesEncoder:
    """Feeds on the service's events; `start()` and `event()` return SSE frames; `response` is the final object."""

    def __init__(
        self,
        *,
        response_id: str,
        model: str,
        echo: dict[str, Any],
        custom_tools: frozenset[str] | set[str] = frozenset(),
        summaries: bool = False,
        seal: Callable[[str], str] | None = None,
        created_at: int | None = None,
    ):
        self.response_id = response_id
        self.custom_tools = custom_tools
        self.summaries = summaries
        self.seal = seal
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items, in output_index order as they complete
        self._items: list[dict[str, Any] | None] = []  # by output_index: the finished item (None while open)
        self._open: dict[str, Any] | None = None  # the open message/reasoning item
        self._calls: dict[int, dict[str, Any]] = {}  # open tool calls by parser index
        # Every call is held until it ends and then goes out whole (added, its arguments, done): clients run a call
        # from its `output_item.done` (Codex reads nothing else of a call), so one the parser abandons (cut off, or
        # malformed mid-stream) must never get one; held, it is never sent at all, and the stream folds to exactly
        # the non-streaming response.
        self._held = HeldCalls()
        self.usage: Usage | None = None
        self.finished = False
        self.error_kind: str | None = None  # the serve_app.errors kind of a failed response
        self.response: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": created_at if created_at is not None else int(time.time()),
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": model,
            "output": [],
            "usage": None,
            **echo,
        }

    # -- framing --------------------------------------------------------------------------------------------

    def _ev(self, type_: str, **fields: Any) -> bytes:
        body = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse.frame(body, type_)

    def _snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": [it for it in self._items if it is not None]}

    def start(self) -> list[bytes]:
        snap = self._snapshot()
        return [self._ev("response.created", response=snap), self._ev("response.in_progress", response=snap)]

    # -- items ----------------------------------------------------------------------------------------------

    def _add_item(self, item: dict[str, Any]) -> tuple[int, bytes]:
        index = len(self._items)
        self._items.append(None)
        return index, self._ev("response.output_item.added", output_index=index, item=item)

    def _done_item(self, index: int, item: dict[str, Any]) -> bytes:
        self._items[index] = item
        return self._ev("response.output_item.done", output_index=index, item=item)

    def _open_message(self, out: list[bytes]) -> dict[str, Any]:
        item_id = new_id("msg")
        index, frame = self._add_item(
            {"type": "message", "id": item_id, "role": "assistant", "status": "in_progress", "content": []})
        out.append(frame)
        out.append(self._ev("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return {"kind": "message", "id": item_id, "index": index, "text": []}

    def _open_reasoning(self, out: list[bytes]) -> dict[str, Any]:
        item_id = new_id("rs")
        if self.summaries:
            index, frame = self._add_item({"type": "reasoning", "id": item_id, "summary": []})
            out.append(frame)
            out.append(self._ev("response.reasoning_summary_part.added", item_id=item_id, output_index=index,
                                summary_index=0, part={"type": "summary_text", "text": ""}))
        else:
            index, frame = self._add_item({"type": "reasoning", "id": item_id, "summary": [], "content": []})
            out.append(frame)
            out.append(self._ev("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                                part={"type": "reasoning_text", "text": ""}))
        return {"kind": "reasoning", "id": item_id, "index": index, "text": []}

    def _close_open(self, out: list[bytes], status: str = "completed") -> None:
        """Finish the open message or reasoning item; `status` "incomplete" when a limit or failure cut it off."""
        cur, self._open = self._open, None
        if cur is None:
            return
        item_id, index, text = cur["id"], cur["index"], "".join(cur["text"])
        if cur["kind"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self._ev("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                                text=text, logprobs=[]))
            out.append(self._ev("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                                part=part))
            item = {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": [part]}
        else:
            if self.summaries:
                part = {"type": "summary_text", "text": text}
                out.append(self._ev("response.reasoning_summary_text.done", item_id=item_id, output_index=index,
                                    summary_index=0, text=text))
                out.append(self._ev("response.reasoning_summary_part.done", item_id=item_id, output_index=index,
                                    summary_index=0, part=part))
                item = {"type": "reasoning", "id": item_id, "summary": [part]}
            else:
                part = {"type": "reasoning_text", "text": text}
                out.append(self._ev("response.reasoning_text.done", item_id=item_id, output_index=index,
                                    content_index=0, text=text))
                out.append(self._ev("response.content_part.done", item_id=item_id, output_index=index,
                                    content_index=0, part=part))
                item = {"type": "reasoning", "id": item_id, "summary": [], "content": [part]}
            if status != "completed":  # reasoning items carry a status only when cut off, as the API's do
                item["status"] = status
            if self.seal is not None:
                item["encrypted_content"] = self.seal(text)
        out.append(self._done_item(index, item))

    # -- events ---------------------------------------------------------------------------------------------

    def event(self, ev: Event) -> list[bytes]:
        out: list[bytes] = []
        for now in self._held.push(ev):
            self._event(now, out)
        return out

    def _event(self, ev: Event, out: list[bytes]) -> None:
        if isinstance(ev, TextDelta):
            if not ev.text:
                return
            if self._open is None or self._open["kind"] != "message":
                self._close_open(out)
                self._open = self._open_message(out)
            cur = self._open
            cur["text"].append(ev.text)
            out.append(self._ev("response.output_text.delta", item_id=cur["id"], output_index=cur["index"],
                                content_index=0, delta=ev.text, logprobs=[]))
        elif isinstance(ev, ReasoningDelta):
            if not ev.text:
                return
            if self._open is None or self._open["kind"] != "reasoning":
                self._close_open(out)
                self._open = self._open_reasoning(out)
            cur = self._open
            cur["text"].append(ev.text)
            if self.summaries:
                out.append(self._ev("response.reasoning_summary_text.delta", item_id=cur["id"],
                                    output_index=cur["index"], summary_index=0, delta=ev.text))
            else:
                out.append(self._ev("response.reasoning_text.delta", item_id=cur["id"], output_index=cur["index"],
                                    content_index=0, delta=ev.text))
        elif isinstance(ev, ToolCallStart):
            self._close_open(out)  # text/reasoning before a call is finished: order is kept on the wire
            custom = ev.name in self.custom_tools
            item_id = new_id("ctc" if custom else "fc")
            call_id = ev.id or new_id("call")
            if custom:
                item = {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": ev.name, "input": "",
                        "status": "in_progress"}
            else:
                item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": ev.name,
                        "arguments": "", "status": "in_progress"}
            index, frame = self._add_item(item)
            out.append(frame)
            self._calls[ev.index] = {"id": item_id, "call_id": call_id, "name": ev.name, "index": index,
                                     "args": [], "custom": _JsonStringValue() if custom else None}
        elif isinstance(ev, ToolCallArgsDelta):
            call = self._calls.get(ev.index)
            if call is None or not ev.arguments:
                return
            call["args"].append(ev.arguments)
            if call["custom"] is not None:
                delta = call["custom"].push(ev.arguments)
                if delta:
                    out.append(self._ev("response.custom_tool_call_input.delta", item_id=call["id"],
                                        output_index=call["index"], delta=delta))
            else:
                out.append(self._ev("response.function_call_arguments.delta", item_id=call["id"],
                                    output_index=call["index"], delta=ev.arguments))
        elif isinstance(ev, ToolCallEnd):
            self._end_call(ev.index, out)
        elif isinstance(ev, Usage):
            if not ev.estimated or self.usage is None:
                self.usage = ev
        elif isinstance(ev, Finish):
            out.extend(self.finish(ev))

    def _end_call(self, index: int, out: list[bytes]) -> None:
        call = self._calls.pop(index, None)
        if call is None:
            return
        args = "".join(call["args"])
        if call["custom"] is not None:
            raw = custom_input_from_arguments(args)
            out.append(self._ev("response.custom_tool_call_input.done", item_id=call["id"],
                                output_index=call["index"], input=raw))
            item = {"type": "custom_tool_call", "id": call["id"], "call_id": call["call_id"], "name": call["name"],
                    "input": raw, "status": "completed"}
        else:
            out.append(self._ev("response.function_call_arguments.done", item_id=call["id"],
                                output_index=call["index"], name=call["name"], arguments=args))
            item = {"type": "function_call", "id": call["id"], "call_id": call["call_id"], "name": call["name"],
                    "arguments": args, "status": "completed"}
        out.append(self._done_item(call["index"], item))

    def _end(self, status: str = "completed") -> list[bytes] | None:
        """Close the open message or reasoning item with `status` and fill in the output and usage; None if the
        response had already ended. An item still open at the end was cut off unless the generation finished on
        its own. No call is ever open here: each goes out whole at its end (HeldCalls), an abandoned one never."""
        if self.finished:
            return None
        self.finished = True
        out: list[bytes] = []
        self._close_open(out, status)
        self.response["output"] = [it for it in self._items if it is not None]
        self.response["usage"] = usage_object(self.usage)
        return out

    def finish(self, fin: Finish) -> list[bytes]:
        if fin.reason == "error":
            return self.fail(error_code(fin.error_kind), fin.error or "engine error", fin.error_kind)
        # The client's max_output_tokens and a full context end the response `incomplete`: OpenAI reports a context
        # that fills during generation as `max_output_tokens` too. The deployment's own cap (one the client did not
        # set) completes it, saying what cut the item: Codex fails the whole turn on `response.incomplete`, and the
        # vendor's models never stop at a limit the client did not set (docs/limits.md).
        cut = fin.reason in ("length", "output_cap", "context_window")
        out = self._end("incomplete" if cut else "completed")
        if out is None:
            return []
        if cut:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        if cut and fin.reason != "output_cap":
            self.response["status"] = "incomplete"
            out.append(self._ev("response.incomplete", response=self.response))
        else:
            self.response["status"] = "completed"
            self.response["completed_at"] = int(time.time())
            out.append(self._ev("response.completed", response=self.response))
        return out

    def fail(self, code: str, message: str, kind: str | None = None) -> list[bytes]:
        """End the stream with `response.failed` (an engine error, or one raised outside the event stream)."""
        out = self._end("incomplete")
        if out is None:
            return []
        self.error_kind = kind
        self.response["status"] = "failed"
        self.response["error"] = {"code": code, "message": message}
        out.append(self._ev("response.failed", response=self.response))
        return out


def fold(encoder: ResponsesEncoder, events: list[Event]) -> dict[str, Any]:
    """The non-streaming response: the same encoder run over the whole stream (so the two cannot disagree)."""
    encoder.start()
    for ev in events:
        encoder.event(ev)
    if not encoder.finished:
        encoder.finish(Finish("error", error="the stream ended without finishing", error_kind="api_error"))
    return encoder.response
