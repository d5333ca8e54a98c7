"""Prefix-stability checks: does turn N+1's prompt start with turn N's prompt + what the model generated?

Used by the template-level unit suite (generated ids = the forced script tokenized, as the forcing logits
processor does), by the engine-backed integration test (ids straight from the engine) and by benchmarks, so
everything here takes token ids from anywhere.

The client round trips (`*_next_turn`) push the generated events through each API's real encoder, fold the
response the way the SDK/harness does, append it to the history as that client sends it back, and run the
API's real request adapter, so the check covers the whole path a turn takes.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

from serve_app.conversation import Conversation, Event, Finish, GenerationOptions, ToolCallStart, Usage


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True)
class StabilityResult:
    cached: list[int]  # turn N prompt ids + generated ids: what the engine holds in its KV cache
    next_ids: list[int]  # turn N+1 prompt ids
    expected: list[int]  # what N+1 must start with (== cached unless the template drops history by design)

    @property
    def reused(self) -> int:
        """Tokens of turn N's cache that N+1 can reuse."""
        return common_prefix(self.cached, self.next_ids)

    @property
    def reused_fraction(self) -> float:
        return self.reused / len(self.cached) if self.cached else 1.0

    @property
    def stable(self) -> bool:
        return self.next_ids[: len(self.expected)] == self.expected

    def diverges_at(self, tokenizer) -> str:
        """A short, readable view of where N+1 leaves the expected ids (for assertion messages)."""
        i = common_prefix(self.expected, self.next_ids)
        want = tokenizer.decode(self.expected[max(0, i - 8): i + 8])
        got = tokenizer.decode(self.next_ids[max(0, i - 8): i + 8])
        return f"at token {i}: expected {want!r}, rendered {got!r}"


def check_turn(prompt_ids: list[int], generated_ids: list[int], next_ids: list[int],
               expected: list[int] | None = None) -> StabilityResult:
    cached = list(prompt_ids) + list(generated_ids)
    return StabilityResult(cached=cached, next_ids=list(next_ids), expected=cached if expected is None else expected)


def with_end(events: list[Event], prompt_tokens: int = 0, completion_tokens: int = 0) -> list[Event]:
    """Parser events plus the Usage and Finish a service stream ends with (the encoders need both)."""
    saw_tool = any(isinstance(e, ToolCallStart) for e in events)
    return [*events, Usage(prompt_tokens, completion_tokens), Finish("tool_calls" if saw_tool else "stop")]


# -- client round trips ------------------------------------------------------------------------------------------

RESULT = "result of {name}"


def anthropic_next_turn(body: dict[str, Any], events: list[Event], secret: bytes, next_user: str,
                        model: str = "m") -> tuple[dict[str, Any], Conversation, GenerationOptions]:
    """Claude Code's next request: the assistant content blocks as received (thinking with its signature,
    text, tool_use), then a user turn of tool_result blocks, or `next_user` text when no tool was called."""
    from serve_app.ingress.anthropic.convert import count_tokens_request, to_conversation
    from serve_app.ingress.anthropic.encode import MessageEncoder, fold

    enc = MessageEncoder(model, "msg_0", thinking=_anthropic_thinking(body), secret=secret)
    stream: list = []
    for ev in with_end(events):
        stream.extend(enc.event(ev))
    content = fold(stream)["content"]
    calls = [b for b in content if b["type"] == "tool_use"]
    if calls:
        user: Any = [{"type": "tool_result", "tool_use_id": b["id"], "content": RESULT.format(name=b["name"])}
                     for b in calls]
    else:
        user = next_user
    nxt = copy.deepcopy(body)
    nxt["messages"] = [*body["messages"], {"role": "assistant", "content": content}, {"role": "user", "content": user}]
    conv, opts = to_conversation(count_tokens_request(nxt), secret)
    return nxt, conv, opts


def _anthropic_thinking(body: dict[str, Any]) -> bool:
    t = body.get("thinking")
    return bool(t) and t.get("type") in ("enabled", "adaptive")


def anthropic_conversation(body: dict[str, Any], secret: bytes) -> tuple[Conversation, GenerationOptions]:
    from serve_app.ingress.anthropic.convert import count_tokens_request, to_conversation

    return to_conversation(count_tokens_request(body), secret)


def responses_next_turn(body: dict[str, Any], events: list[Event], secret: bytes, next_user: str,
                        model: str = "m") -> tuple[dict[str, Any], Conversation, GenerationOptions]:
    """Codex's next request (stateless, `store: false`): the previous input, the output items as received
    (reasoning with encrypted_content, message, function_call), then function_call_output items or a user
    message."""
    from serve_app.ingress.responses.encode import ResponsesEncoder, fold
    from serve_app.ingress.responses.reasoning_crypto import ReasoningSealer

    sealer = ReasoningSealer(secret)
    enc = ResponsesEncoder(response_id="resp_0", model=model, echo={}, seal=sealer.seal)
    output = fold(enc, with_end(events))["output"]
    calls = [item for item in output if item["type"] == "function_call"]
    if calls:
        follow: list[dict[str, Any]] = [{"type": "function_call_output", "call_id": c["call_id"],
                                         "output": RESULT.format(name=c["name"])} for c in calls]
    else:
        follow = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": next_user}]}]
    nxt = copy.deepcopy(body)
    prior = body["input"] if isinstance(body["input"], list) else [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": body["input"]}]}]
    nxt["input"] = [*prior, *output, *follow]
    conv, opts = responses_conversation(nxt, secret)
    return nxt, conv, opts


def responses_conversation(body: dict[str, Any], secret: bytes) -> tuple[Conversation, GenerationOptions]:
    from serve_app.ingress.responses.convert import responses_to_conversation
    from serve_app.ingress.responses.reasoning_crypto import ReasoningSealer
    from serve_app.ingress.responses.convert import parse_responses_request

    sealer = ReasoningSealer(secret)
    return responses_to_conversation(parse_responses_request(body),
                                     lambda token, param: sealer.open(token, param=param))


def chat_next_turn(body: dict[str, Any], events: list[Event], next_user: str,
                   model: str = "m") -> tuple[dict[str, Any], Conversation, GenerationOptions]:
    """An OpenAI-SDK agent's next request: the response message as received (content, reasoning_content,
    tool_calls), then one `tool` message per call, or a user message."""
    from serve_app.ingress.chat.encode import completion_body

    message = completion_body(model, "0", with_end(events))["choices"][0]["message"]
    follow: list[dict[str, Any]]
    if message.get("tool_calls"):
        follow = [{"role": "tool", "tool_call_id": c["id"], "content": RESULT.format(name=c["function"]["name"])}
                  for c in message["tool_calls"]]
    else:
        follow = [{"role": "user", "content": next_user}]
    nxt = copy.deepcopy(body)
    nxt["messages"] = [*body["messages"], message, *follow]
    conv, opts = chat_conversation(nxt)
    return nxt, conv, opts


def chat_conversation(body: dict[str, Any]) -> tuple[Conversation, GenerationOptions]:
    from serve_app.ingress.chat.convert import chat_request_to_conversation

    _, conv, opts = chat_request_to_conversation(json.loads(json.dumps(body)))
    return conv, opts


# -- real templates: what the model emits, and what a template drops by design -----------------------------------

def unreplayed_empty_block(prompt: str, full: str, markers: tuple[str, str] | None) -> str:
    """The empty think block a thinking-off generation prompt ends with (`<|channel>thought\n<channel|>`) when the
    turn rendered into history leaves it out; "" otherwise."""
    if not markers or full.startswith(prompt):
        return ""
    start, end = markers
    at = prompt.rfind(start)
    block = prompt[at:] if at >= 0 else ""
    inner = block[len(start):]
    if not block.endswith(end) or not re.fullmatch(r"\s*\w*\s*", inner[: len(inner) - len(end)]):
        return ""  # not a closed block with at most a role label in it
    return block if full.startswith(prompt[:at]) else ""


def emitted_text(renderer, conv: Conversation, parts: list, opts: GenerationOptions, stop_tokens: list[str],
                 tool_starts: tuple[str, ...] = ()) -> tuple[str, str, bool]:
    """What a model trained on its template generates for the assistant turn `parts` after `conv`: the
    conversation rendered with the turn as its last message minus the prompt rendered with the generation prompt,
    cut at the end-of-turn token. Returns (prompt text, generated text, prompt starts in reasoning).

    Some templates render a final answer differently once it exists (Kimi K2 and gpt-oss drop the thinking of
    the whole exchange, the answer's own included): then the answer is rendered as the current turn by giving it
    a placeholder call, and cut where the call's markup begins (`tool_starts`)."""
    from serve_app.conversation import Message, ReasoningPart, TextPart, ToolCallPart

    prompt = renderer.render_sync(conv, opts)

    def render(turn: list) -> str:
        return renderer.render_text(Conversation(messages=[*conv.messages, Message("assistant", turn)],
                                                 tools=conv.tools, tool_choice=conv.tool_choice), opts,
                                    add_generation_prompt=False)

    full = render(parts)
    out: str | None = full[len(prompt.text):] if full.startswith(prompt.text) else None
    block = unreplayed_empty_block(prompt.text, full, renderer.policy.markers)
    if out is None and block:  # thinking off, the template drops the empty block (Gemma 4): the turn follows it
        out = full[len(prompt.text) - len(block):]
    first = next((p.text for p in parts if isinstance(p, (ReasoningPart, TextPart)) and p.text), None)
    if out is None and first is not None and first in full:
        # The turn is all there but earlier turns render differently now (gpt-oss): it starts after the last
        # generation prompt in front of its first words.
        at = full.rfind(first)
        starts = [full.rfind(t, 0, at) + len(t) for t in renderer.turn_starts if full.rfind(t, 0, at) >= 0]
        if starts:
            out = full[max(starts):]
    if out is None and tool_starts and not any(isinstance(p, ToolCallPart) for p in parts):
        held = render([*parts, ToolCallPart("call_placeholder", "placeholder", "{}")])
        if held.startswith(prompt.text):
            tail = held[len(prompt.text):]
            cut = min((tail.find(t) for t in tool_starts if t in tail), default=-1)
            if cut >= 0:
                out = tail[:cut]
    if out is None:
        raise ValueError("the rendered turn does not extend the generation prompt")
    ends = [out.rfind(t) for t in stop_tokens if t in out]
    if ends:
        out = out[: max(ends)]
    return prompt.text, out, prompt.starts_in_reasoning


def dropped_blocks(cached: str, nxt: str, reasonings: list[str]) -> list[str] | None:
    """Where turn N+1's prompt leaves turn N's cached text, the template dropped earlier thinking by design iff
    skipping one block that holds a reasoning text (and only markup or whitespace besides) realigns the two. The
    skipped blocks, in order ([] when `nxt` extends `cached`); None when some divergence is not such a block."""
    skipped: list[str] = []
    i = j = 0
    while True:
        n = min(len(cached) - i, len(nxt) - j)
        k = 0
        while k < n and cached[i + k] == nxt[j + k]:
            k += 1
        i, j = i + k, j + k
        if i == len(cached):
            return skipped
        # Diverging inside a marker ("<think>" against "<tool_call>"): the block starts at the marker.
        lt = cached.rfind("<", max(0, i - 16), i)
        if lt >= 0 and ">" not in cached[lt:i]:
            j -= i - lt
            i = lt
        for r in reasonings:
            at = cached.find(r, i)
            if at < 0 or at - i > 64:  # the block starts within a marker's reach of the divergence
                continue
            for end in range(at + len(r), min(len(cached), at + len(r) + 64) + 1):
                rest = cached[end: end + 12]  # enough to realign on; the loop then checks the rest
                if nxt.startswith(rest, j) and (end == len(cached) or rest):
                    skipped.append(cached[i:end])
                    i = end
                    break
            else:
                continue
            break
        else:
            return None


# -- one agent's requests, per API -------------------------------------------------------------------------------

def agent_request(api: str, thinking: bool, system: str, user: str, tools: list[tuple[str, str, dict]],
                  header: str | None = None) -> dict[str, Any]:
    """The first request of a coding-agent session as each harness sends it: Claude Code (Anthropic, billing
    header as system block 0, adaptive thinking), Codex (Responses, stateless with encrypted reasoning), an
    OpenAI-SDK agent (Chat Completions, thinking off through chat_template_kwargs)."""
    if api == "anthropic":
        blocks = ([{"type": "text", "text": header}] if header else []) + [{"type": "text", "text": system}]
        return {"model": "m", "system": blocks, "messages": [{"role": "user", "content": user}],
                "tools": [{"name": n, "description": d, "input_schema": s} for n, d, s in tools],
                "thinking": {"type": "adaptive"} if thinking else {"type": "disabled"}}
    if api == "responses":
        return {"model": "m", "instructions": system, "store": False, "include": ["reasoning.encrypted_content"],
                "reasoning": {"effort": "medium" if thinking else "none"},
                "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]}],
                "tools": [{"type": "function", "name": n, "description": d, "parameters": s} for n, d, s in tools]}
    body: dict[str, Any] = {
        "model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "tools": [{"type": "function", "function": {"name": n, "description": d, "parameters": s}}
                  for n, d, s in tools]}
    if not thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def api_conversation(api: str, body: dict[str, Any], secret: bytes) -> tuple[Conversation, GenerationOptions]:
    if api == "anthropic":
        return anthropic_conversation(body, secret)
    if api == "responses":
        return responses_conversation(body, secret)
    return chat_conversation(body)


def api_next_turn(api: str, body: dict[str, Any], events: list[Event], secret: bytes, next_user: str
                  ) -> tuple[dict[str, Any], Conversation, GenerationOptions]:
    if api == "anthropic":
        return anthropic_next_turn(body, events, secret, next_user)
    if api == "responses":
        return responses_next_turn(body, events, secret, next_user)
    return chat_next_turn(body, events, next_user)
