"""Anthropic Messages request → Conversation + GenerationOptions.

Rules from harness-contracts A3: `system` string or blocks (the billing-header block is kept; the prompt pipeline
strips it), `role:"system"` messages inside `messages`, `thinking` adaptive/enabled → on, disabled or absent → off
(ollama#15287), signed thinking blocks verified (tampered/foreign → the API's own 400 wording, which Claude Code
recovers from), `tool_result` string or blocks as `tool` messages, images/documents as parts (the service says
400 when the model cannot take them), tool ids mapped back from the `toolu_` form this server hands out.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from typing import Any, Mapping

from serve_app.conversation import (
    Conversation,
    DocumentPart,
    GenerationOptions,
    ImagePart,
    Message,
    Part,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    ToolSpec,
)
from serve_app.errors import InvalidRequest
from serve_app.ingress import output_format
from serve_app.ingress.anthropic import signatures
from serve_app.ingress.common import agent_hints, parse_model
from serve_app.protocols import anthropic as wire

# -- tool ids --------------------------------------------------------------------------------------------------
# The parsers name calls `call_<hex>`, or keep a model-generated id (Kimi's `functions.NAME:0`) that the template
# renders back. Anthropic clients expect `toolu_…` matching ^[A-Za-z0-9_-]+$, so ids are mapped reversibly and
# the next turn's prompt sees exactly the id the model (or parser) produced.

_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]+$")
_B64 = "toolu_b64_"


def wire_tool_id(call_id: str) -> str:
    if call_id.startswith("call_") and _SAFE_ID.match(call_id):
        return "toolu_" + call_id[5:]
    if call_id.startswith("toolu_") and not call_id.startswith(_B64) and _SAFE_ID.match(call_id):
        return call_id
    return _B64 + base64.urlsafe_b64encode(call_id.encode()).decode().rstrip("=")


def ir_tool_id(wire_id: str) -> str:
    if wire_id.startswith(_B64):
        raw = wire_id[len(_B64):]
        try:
            return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return wire_id
    if wire_id.startswith("toolu_"):
        return "call_" + wire_id[6:]
    return wire_id


# -- request parsing -------------------------------------------------------------------------------------------


def _image(block: wire.ImageBlock, where: str) -> ImagePart:
    src = block.source
    if isinstance(src, wire.Base64Source):
        return ImagePart(media_type=src.media_type, data=src.data)
    if isinstance(src, wire.UrlSource):
        return ImagePart(url=src.url)
    raise InvalidRequest(f"{where}.source: file sources are not supported by this server", param=f"{where}.source")


def _document(block: wire.DocumentBlock, where: str) -> DocumentPart:
    src = block.source
    if isinstance(src, wire.Base64Source):
        return DocumentPart(media_type=src.media_type, data=src.data)
    if isinstance(src, wire.TextSource):
        return DocumentPart(media_type=src.media_type or "text/plain", text=src.data)
    if isinstance(src, wire.ContentSource):
        if isinstance(src.content, str):
            return DocumentPart(media_type="text/plain", text=src.content)
        texts = [b.get("text", "") for b in src.content if isinstance(b, dict) and b.get("type") == "text"]
        return DocumentPart(media_type="text/plain", text="\n".join(texts))
    raise InvalidRequest(
        f"{where}.source: {src.type} document sources are not supported by this server", param=f"{where}.source"
    )


def _tool_result(block: wire.ToolResultBlock, where: str) -> ToolResultPart:
    content: str | list[Part]
    if block.content is None:
        content = ""
    elif isinstance(block.content, str):
        content = block.content
    else:
        parts: list[Part] = []
        for j, b in enumerate(block.content):
            if isinstance(b, wire.TextBlock):
                parts.append(TextPart(b.text))
            elif isinstance(b, wire.ImageBlock):
                parts.append(_image(b, f"{where}.content.{j}"))
            elif isinstance(b, wire.DocumentBlock):
                parts.append(_document(b, f"{where}.content.{j}"))
        # One text block is the common case; a plain string renders the same way in every template.
        content = parts[0].text if len(parts) == 1 and isinstance(parts[0], TextPart) else parts
    return ToolResultPart(tool_call_id=ir_tool_id(block.tool_use_id), content=content, is_error=bool(block.is_error))


def _thinking(block: wire.ThinkingBlock, where: str, secret: bytes) -> ReasoningPart | None:
    if not block.signature:
        # Unsigned thinking cannot be proven to be this model's: it is not replayed into the prompt.
        return None
    if not signatures.verify(secret, block.thinking, block.signature):
        # The real API's wording: Claude Code and proxies recognise it and retry without the thinking blocks.
        raise InvalidRequest(f"{where}: Invalid `signature` in `thinking` block", param=where)
    return ReasoningPart(block.thinking, signature=block.signature)


def _messages(req: wire.CountTokensRequest, secret: bytes) -> list[Message]:
    out: list[Message] = []
    if req.system is not None:
        if isinstance(req.system, str):
            if req.system:
                out.append(Message("system", [TextPart(req.system)]))
        else:
            parts: list[Part] = [TextPart(b.text) for b in req.system if b.text]
            if parts:
                out.append(Message("system", parts))
    answerable: set[str] = set()  # tool_use ids of the message just before: what a tool_result may answer
    for i, msg in enumerate(req.messages):
        where = f"messages.{i}"
        asked, answerable = answerable, set()
        if isinstance(msg.content, str):
            out.append(Message(msg.role, [TextPart(msg.content)] if msg.content else []))
            continue
        pending: list[Part] = []

        def flush() -> None:
            if pending:
                out.append(Message(msg.role, list(pending)))
                pending.clear()

        for j, block in enumerate(msg.content):
            bw = f"{where}.content.{j}"
            if isinstance(block, wire.TextBlock):
                if block.text:
                    pending.append(TextPart(block.text))
            elif isinstance(block, wire.ImageBlock):
                pending.append(_image(block, bw))
            elif isinstance(block, wire.DocumentBlock):
                pending.append(_document(block, bw))
            elif isinstance(block, wire.ToolUseBlock):
                if msg.role != "assistant":
                    raise InvalidRequest(f"{bw}: tool_use blocks belong in assistant messages", param=bw)
                answerable.add(block.id)
                pending.append(
                    ToolCallPart(
                        id=ir_tool_id(block.id),
                        name=block.name,
                        arguments=json.dumps(block.input, ensure_ascii=False),
                    )
                )
            elif isinstance(block, wire.ToolResultBlock):
                if msg.role != "user":
                    raise InvalidRequest(f"{bw}: tool_result blocks belong in user messages", param=bw)
                if block.tool_use_id not in asked:  # the API's own check and wording
                    raise InvalidRequest(
                        f"{bw}: unexpected `tool_use_id` found in `tool_result` blocks: {block.tool_use_id}. Each "
                        "`tool_result` block must have a corresponding `tool_use` block in the previous message.",
                        param=bw,
                    )
                # Each result is its own `tool` message (the Chat Completions shape every template knows),
                # kept in order with the user text around it.
                flush()
                out.append(Message("tool", [_tool_result(block, bw)]))
            elif isinstance(block, wire.ThinkingBlock):
                if msg.role == "assistant":
                    part = _thinking(block, bw, secret)
                    if part is not None:
                        pending.append(part)
            # redacted_thinking: accepted and not rendered (this server never emits it; its data is opaque).
            # Unknown block types (future Claude Code blocks) are skipped rather than refused.
        flush()
    return out


def _tools(req: wire.CountTokensRequest) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    for i, t in enumerate(req.tools or []):
        if t.input_schema is None or (t.type not in (None, "custom")):
            raise InvalidRequest(
                f"tools.{i}: server tool {t.type or t.name!r} is not supported by this server; "
                "send client tools with an input_schema",
                param=f"tools.{i}",
            )
        specs.append(ToolSpec(name=t.name, description=t.description or "", parameters=t.input_schema))
    return specs


def _tool_choice(tc: wire.ToolChoiceSpec | None) -> ToolChoice:
    if tc is None:
        return ToolChoice("auto")
    parallel = not tc.disable_parallel_tool_use
    if tc.type == "tool":
        if not tc.name:
            raise InvalidRequest("tool_choice.name: Field required", param="tool_choice.name")
        return ToolChoice("tool", name=tc.name, parallel=parallel)
    mode = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
    return ToolChoice(mode, parallel=parallel)


def session_key(metadata: wire.Metadata | None, headers: Mapping[str, str] | None) -> str | None:
    """Claude Code's session id (header, or `metadata.user_id`'s JSON) as the sticky-routing key."""
    if headers is not None:
        sid = headers.get("x-claude-code-session-id")
        if sid:
            return sid
    user_id = metadata.user_id if metadata is not None else None
    if not user_id:
        return None
    try:
        parsed = json.loads(user_id)
    except ValueError:
        return user_id
    if isinstance(parsed, dict):
        sid = parsed.get("session_id")
        if isinstance(sid, str) and sid:
            return sid
    return user_id


def thinking_on(req: wire.CountTokensRequest) -> bool:
    # Absent means off: a model must not think unasked (ollama#15287).
    return req.thinking is not None and req.thinking.type in ("enabled", "adaptive")


def to_conversation(
    req: wire.CountTokensRequest, secret: bytes, headers: Mapping[str, str] | None = None
) -> tuple[Conversation, GenerationOptions]:
    conv = Conversation(messages=_messages(req, secret), tools=_tools(req), tool_choice=_tool_choice(req.tool_choice))
    if thinking_on(req) and conv.tool_choice.mode in ("required", "tool"):
        # The API's rule and wording (Claude Code demotes a forced tool to auto when thinking is on).
        raise InvalidRequest("Thinking may not be enabled when tool_choice forces tool use.", param="tool_choice")
    nvext = req.nvext
    opts = GenerationOptions(
        thinking=thinking_on(req),
        reasoning_effort=req.output_config.effort if req.output_config is not None else None,
        session_key=session_key(req.metadata, headers),
        hints=agent_hints(nvext.agent_hints if nvext else None),
        forced_script=nvext.forced_script if nvext else None,
    )
    if req.output_config is not None and req.output_config.format is not None:
        opts.output_format = output_format.from_anthropic(req.output_config.format, "output_config.format")
    elif req.output_format is not None:
        opts.output_format = output_format.from_anthropic(req.output_format, "output_format")
    if isinstance(req, wire.MessagesRequest):
        if req.max_tokens < 1:
            raise InvalidRequest("max_tokens: must be greater than or equal to 1", param="max_tokens")
        opts.max_tokens = req.max_tokens  # clamped by the service to what fits, never refused for size
        opts.temperature = req.temperature
        opts.top_p = req.top_p
        opts.top_k = req.top_k
        opts.stop = [s for s in (req.stop_sequences or []) if s]
    return conv, opts


def messages_request(body: dict[str, Any]) -> wire.MessagesRequest:
    return parse_model(wire.MessagesRequest, body)


def count_tokens_request(body: dict[str, Any]) -> wire.CountTokensRequest:
    # count_tokens bodies may still carry max_tokens/stream (SDKs reuse the create params): ignored.
    return parse_model(wire.CountTokensRequest, body)

