"""Conversation (the IR) → the message list HF chat templates take, following the model's replay policy.

The shape is the one vLLM's renderer hands templates: `role`/`content` strings, assistant `tool_calls` as
OpenAI objects with `function.arguments` parsed into a dict (or the verbatim JSON text when the template prints
strings as-is), `tool` messages with `tool_call_id`, reasoning in `reasoning_content` (and `reasoning`), tools as
OpenAI function schemas.
"""

from __future__ import annotations

import json
from typing import Any

from serve_app.conversation import (
    Conversation,
    DocumentPart,
    ImagePart,
    Message,
    Part,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
)
from serve_app.errors import InvalidRequest
from serve_app.prompt.policy import ReplayPolicy

# Blocks of one message are joined with a newline; assistant text with nothing (it is the model's own output
# split by the parser, so plain concatenation gives back exactly what was generated).
_JOIN = "\n"
_PARAGRAPHS = "\n\n"  # messages joined into one (ReplayPolicy.merge_leading_system, merge_user_runs): paragraphs


def _document_text(doc: DocumentPart) -> str:
    """A text document as prompt text: its provenance first (title, source, context: what a reader of the document
    would see around it), then the text. Without any, the text alone."""
    head = [f"{label}: {value}" for label, value in (("Title", doc.title), ("Source", doc.source),
                                                       ("Context", doc.context)) if value]
    return _JOIN.join([*head, doc.text or ""])


def _text_of(part: Part, where: str) -> str:
    if isinstance(part, TextPart):
        return part.text
    if isinstance(part, DocumentPart):
        if part.text is not None:
            return _document_text(part)
        raise InvalidRequest(f"{where}: this model takes text only; a {part.media_type or 'binary'} document "
                             "cannot be rendered into its prompt", param=where)
    if isinstance(part, ImagePart):
        raise InvalidRequest(f"{where}: this model takes text only; images cannot be rendered into its prompt",
                             param=where)
    raise InvalidRequest(f"{where}: unexpected {type(part).__name__} here", param=where)


def _tool_result_text(content: str | list[Part], where: str) -> str:
    if isinstance(content, str):
        return content
    return _JOIN.join(_text_of(p, where) for p in content)


def _arguments(call: ToolCallPart, policy: ReplayPolicy) -> Any:
    if policy.arguments_as_string:
        return call.arguments
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        # vLLM's rule for malformed history: an unparseable object becomes {} rather than failing the turn;
        # a custom (freeform) tool's input is text, kept under `input`.
        return {"input": call.arguments} if call.kind == "custom" else {}
    return value if isinstance(value, dict) else {"input": value}


def _tool_call(call: ToolCallPart, policy: ReplayPolicy) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": _arguments(call, policy)}}


def _unwrap(text: str, affixes: tuple[str, str]) -> str:
    head, tail = affixes
    if head and text.startswith(head):
        text = text[len(head):]
    if tail and text.endswith(tail):
        text = text[: len(text) - len(tail)]
    return text


def _segments(parts: list[Part], policy: ReplayPolicy | None = None) -> list[list[Part]]:
    """Split an assistant turn where reasoning or text follows a tool call (or reasoning follows text), so each
    reasoning segment stays with the calls it explains, in order: think₀ call₀ think₁ call₁ → two turns."""
    if (policy is not None and policy.lead_text and len(parts) > 1 and isinstance(parts[0], TextPart)
            and parts[0].text == policy.lead_text and isinstance(parts[1], ReasoningPart)):
        parts = parts[1:]  # the template writes it in front of the think block itself
    segments: list[list[Part]] = [[]]
    for part in parts:
        cur = segments[-1]
        has_call = any(isinstance(p, ToolCallPart) for p in cur)
        has_text = any(isinstance(p, TextPart) for p in cur)
        if cur and ((isinstance(part, (ReasoningPart, TextPart)) and has_call)
                    or (isinstance(part, ReasoningPart) and has_text)):
            segments.append([])
        segments[-1].append(part)
    return segments


def _assistant(parts: list[Part], policy: ReplayPolicy, where: str, thinking_off: bool = False) -> dict[str, Any]:
    reasoning = "".join(p.text for p in parts if isinstance(p, ReasoningPart) and not p.redacted)
    text = "".join(_text_of(p, where) for p in parts if not isinstance(p, (ReasoningPart, ToolCallPart)))
    calls = [p for p in parts if isinstance(p, ToolCallPart)]
    out: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        out["tool_calls"] = [_tool_call(c, policy) for c in calls]
    if policy.mode == "field":
        out["content"] = _unwrap(text, policy.text_affixes if calls else policy.answer_affixes)
    if reasoning:
        if policy.mode == "field":
            for key in policy.fields:
                out[key] = _unwrap(reasoning, policy.reasoning_affixes)
        elif policy.markers and (policy.mode == "inline" or (calls and policy.inline_tool_reasoning)):
            out["content"] = policy.opener + reasoning + policy.markers[1] + text
        # drop mode, no tool call: the model was trained without its earlier thinking.
    elif thinking_off and policy.empty_replay != "none" and policy.markers:
        # Generated right after the prompt's empty think block: give the block back so the turn replays as is.
        if policy.empty_replay == "field":
            start, end = policy.markers
            inner = policy.empty_block[len(start):policy.empty_block.index(end)]
            for key in policy.fields:
                out[key] = inner
        else:
            out["content"] = policy.empty_block + text
    if policy.empty_turn_as_blocks and out["content"] == "" and not calls:
        out["content"] = [{"type": "text", "text": ""}]
    return out


def _user_like(msg: Message, i: int, call_names: dict[str, str]) -> list[dict[str, Any]]:
    """A user or tool message: tool results become `tool` messages, text between them a user message."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": _JOIN.join(texts)})
            texts.clear()

    for j, part in enumerate(msg.parts):
        where = f"messages.{i}.content.{j}"
        if isinstance(part, ToolResultPart):
            flush()
            tool: dict[str, Any] = {"role": "tool", "tool_call_id": part.tool_call_id,
                                    "content": _tool_result_text(part.content, where)}
            name = part.name or call_names.get(part.tool_call_id)
            if name:
                tool["name"] = name
            out.append(tool)
        elif isinstance(part, ReasoningPart):
            continue  # only assistant turns carry reasoning
        else:
            texts.append(_text_of(part, where))
    flush()
    if not out and msg.role == "user":
        out.append({"role": "user", "content": ""})
    return out


def _add(out: list[dict[str, Any]], msg: dict[str, Any], policy: ReplayPolicy) -> None:
    """Append one template message. Under a template whose turns alternate, user text joins the user turn before
    it: the user message it follows, or the tool results it follows (see ReplayPolicy.merge_user_runs)."""
    prev = out[-1] if out else None
    if msg["role"] == "user" and prev is not None and (
            (prev["role"] == "user" and policy.merge_user_runs)
            or (prev["role"] == "tool" and policy.user_text_into_tool_result)):
        prev["content"] = _PARAGRAPHS.join(t for t in (prev["content"], msg["content"]) if t)
        return
    out.append(msg)


def to_template_messages(conv: Conversation, policy: ReplayPolicy, *, thinking_off: bool = False
                         ) -> list[dict[str, Any]]:
    """`thinking_off`: this request renders with thinking disabled (see ReplayPolicy.empty_replay)."""
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    lead_end = next((i for i, m in enumerate(conv.messages) if m.role not in ("system", "developer")),
                    len(conv.messages))
    for i, msg in enumerate(conv.messages):
        where = f"messages.{i}"
        if msg.role in ("system", "developer"):
            role = "developer" if msg.role == "developer" and policy.developer_role else "system"
            text = _JOIN.join(_text_of(p, f"{where}.content.{j}") for j, p in enumerate(msg.parts))
            leading = i < lead_end
            if leading and out and policy.merge_leading_system:
                out[0]["content"] += _PARAGRAPHS + text
            elif not leading and policy.later_system_as_user:
                _add(out, {"role": "user", "content": text}, policy)
            else:
                out.append({"role": role, "content": text})
        elif msg.role == "assistant":
            for seg in _segments(msg.parts, policy):
                for p in seg:
                    if isinstance(p, ToolCallPart):
                        call_names[p.id] = p.name
                out.append(_assistant(seg, policy, where, thinking_off))
        else:
            for m in _user_like(msg, i, call_names):
                _add(out, m, policy)
    return out


# A custom (freeform) tool takes raw text; templates only know functions, so it is one with a single string
# parameter `input` (the call's arguments are then `{"input": "..."}`, see responses/convert.custom_arguments).
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The raw freeform input for this tool."}},
    "required": ["input"],
}


def to_template_tools(tools: list[ToolSpec]) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {
        "name": t.name, "description": t.description,
        "parameters": CUSTOM_PARAMETERS if t.kind == "custom" else t.parameters}} for t in tools]
