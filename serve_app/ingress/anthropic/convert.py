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


# -- block types ------------------------------------------------------------------------------------------------
# Every content block type the API documents (the current SDK's ContentBlockParam, betas included): the list the
# API's own 400 names when a block's `type` is none of them.
_DOCUMENTED_BLOCKS = (
    "advisor_tool_result", "bash_code_execution_tool_result", "code_execution_tool_result", "compaction",
    "container_upload", "document", "fallback", "image", "mcp_tool_listing", "mcp_tool_result", "mcp_tool_use",
    "redacted_thinking", "search_result", "server_tool_use", "text", "text_editor_code_execution_tool_result",
    "thinking", "tool_addition", "tool_removal", "tool_result", "tool_search_tool_result", "tool_use",
    "web_fetch_tool_result", "web_search_tool_result",
)
_DOCUMENTED_RESULT_BLOCKS = ("browser_state", "document", "image", "search_result", "text", "tool_reference")
# What the rest are: blocks that only the API's own server-side machinery produces or consumes (server tools, MCP
# connectors, containers, compaction, tool search, model fallbacks). This server runs none of it, so it cannot act
# on them, and dropping them would hide part of the conversation from the model: refused, naming the type.
_SERVER_SIDE = "this server runs no server tools, MCP connectors, containers, compaction, tool search or fallbacks"


def _refuse_block(block_type: str, where: str, documented: tuple[str, ...]) -> InvalidRequest:
    if block_type in documented:
        return InvalidRequest(f"{where}: `{block_type}` blocks are not supported by this server ({_SERVER_SIDE})",
                              param=f"{where}.type")
    # The API's own wording (pydantic's tagged-union error), so clients that match on it recognise it.
    tags = ", ".join(f"'{t}'" for t in documented)
    return InvalidRequest(f"{where}: Input tag '{block_type}' found using 'type' does not match any of the "
                          f"expected tags: {tags}", param=f"{where}.type")


def _document(block: wire.DocumentBlock, where: str) -> list[Part]:
    """A document's text reaches the prompt with its title and context; a PDF stays binary (models that cannot
    take it refuse it when rendering); an image inside a content source follows the document as an image."""
    src = block.source
    meta = {"title": block.title, "context": block.context}
    if isinstance(src, wire.Base64Source):
        return [DocumentPart(media_type=src.media_type, data=src.data, **meta)]
    if isinstance(src, wire.TextSource):
        return [DocumentPart(media_type=src.media_type or "text/plain", text=src.data, **meta)]
    if isinstance(src, wire.ContentSource):
        if isinstance(src.content, str):
            return [DocumentPart(media_type="text/plain", text=src.content, **meta)]
        texts: list[str] = []
        images: list[Part] = []
        for k, raw in enumerate(src.content):
            bw = f"{where}.source.content.{k}"
            kind = raw.get("type") if isinstance(raw, dict) else None
            if kind == "text" and isinstance(raw.get("text"), str):
                texts.append(raw["text"])
            elif kind == "image":
                images.append(_image(parse_model(wire.ImageBlock, raw), bw))
            else:
                raise _refuse_block(str(kind), bw, ("image", "text"))
        return [DocumentPart(media_type="text/plain", text="\n".join(texts), **meta), *images]
    raise InvalidRequest(
        f"{where}.source: {src.type} document sources are not supported by this server", param=f"{where}.source"
    )


def _search_result(block: wire.SearchResultBlock) -> DocumentPart:
    # Rendered like a text document: its title and source, then its text blocks (citations are never produced).
    return DocumentPart(media_type="text/plain", text="\n".join(b.text for b in block.content),
                        title=block.title, source=block.source)


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
                parts.extend(_document(b, f"{where}.content.{j}"))
            elif isinstance(b, wire.SearchResultBlock):
                parts.append(_search_result(b))
            else:
                raise _refuse_block(b.type, f"{where}.content.{j}", _DOCUMENTED_RESULT_BLOCKS)
        # One text block is the common case; a plain string renders the same way in every template.
        content = parts[0].text if len(parts) == 1 and isinstance(parts[0], TextPart) else parts
    return ToolResultPart(tool_call_id=ir_tool_id(block.tool_use_id), content=content, is_error=bool(block.is_error))


def _thinking(block: wire.ThinkingBlock, where: str, secret: bytes) -> ReasoningPart | None:
    if not block.signature:
        # Unsigned thinking cannot be proven to be this model's: it is not replayed into the prompt.
        return None
    text: str | None = block.thinking
    if block.signature.startswith(signatures.SEALED):
        # Sent with `display: "omitted"`: the text comes back empty and the signature holds it (a client may also
        # send it back filled in, then it must be the sealed text).
        sealed = signatures.unseal(secret, block.signature)
        text = sealed if sealed is not None and block.thinking in ("", sealed) else None
    elif not signatures.verify(secret, block.thinking, block.signature):
        text = None
    if text is None:
        # The real API's wording: Claude Code and proxies recognise it and retry without the thinking blocks.
        raise InvalidRequest(f"{where}: Invalid `signature` in `thinking` block", param=where)
    return ReasoningPart(text, signature=block.signature)


def _check_text(text: str, field: str, where: str) -> None:
    """The API's rule for text blocks, in its words: neither empty nor only whitespace."""
    if not text:
        raise InvalidRequest(f"{field}: text content blocks must be non-empty", param=where)
    if not text.strip():
        raise InvalidRequest(f"{field}: text content blocks must contain non-whitespace text", param=where)


def _system(req: wire.CountTokensRequest) -> list[Message]:
    if req.system is None:
        return []
    if isinstance(req.system, str):
        return [Message("system", [TextPart(req.system)])] if req.system else []
    for k, b in enumerate(req.system):
        _check_text(b.text, "system", f"system.{k}.text")
    return [Message("system", [TextPart(b.text) for b in req.system])] if req.system else []


def _unanswered(i: int, asked: list[str], answered: set[str]) -> None:
    """The API's reverse pairing rule: every `tool_use` of message i is answered by a `tool_result` in the message
    right after it. Checked once that message was read, so its own errors (a result answering nothing) come first,
    and never for a final assistant message (a prefill, or a conversation counted as it stands)."""
    missing = [tid for tid in asked if tid not in answered]
    if missing:
        raise InvalidRequest(
            f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
            f"{', '.join(missing)}. Each `tool_use` block must have a corresponding `tool_result` block in the next "
            "message.", param=f"messages.{i}")


def _messages(req: wire.CountTokensRequest, secret: bytes) -> list[Message]:
    out = _system(req)
    asked: list[str] = []  # tool_use ids of the message just before: what a tool_result may answer
    last = len(req.messages) - 1
    for i, msg in enumerate(req.messages):
        where = f"messages.{i}"
        prefill = i == last and msg.role == "assistant"
        # The API exempts only a final assistant message; this server exempts every assistant message: a small
        # model can end a turn with nothing to show (thinking off, an immediate end of turn), and a client that
        # sends that turn back as it came must not be refused for it.
        if not msg.content and msg.role != "assistant":
            raise InvalidRequest(f"{where}: all messages must have non-empty content except for the optional final "
                                 "assistant message", param=where)
        uses: list[str] = []
        answered: set[str] = set()
        if isinstance(msg.content, str):
            if msg.content and not prefill:
                _check_text(msg.content, "messages", f"{where}.content")
            out.append(Message(msg.role, [TextPart(msg.content)] if msg.content else []))
            if asked:
                _unanswered(i - 1, asked, answered)
            asked = uses
            continue
        pending: list[Part] = []

        def flush() -> None:
            if pending:
                out.append(Message(msg.role, list(pending)))
                pending.clear()

        for j, block in enumerate(msg.content):
            bw = f"{where}.content.{j}"
            if isinstance(block, wire.TextBlock):
                # A prefill's last block may be only whitespace: that is its own rule (trailing whitespace, _prefill)
                if not (prefill and j == len(msg.content) - 1 and block.text):
                    _check_text(block.text, "messages", f"{bw}.text")
                pending.append(TextPart(block.text))
            elif isinstance(block, wire.ImageBlock):
                pending.append(_image(block, bw))
            elif isinstance(block, wire.DocumentBlock):
                pending.extend(_document(block, bw))
            elif isinstance(block, wire.SearchResultBlock):
                pending.append(_search_result(block))
            elif isinstance(block, wire.ToolUseBlock):
                if msg.role != "assistant":
                    raise InvalidRequest(f"{bw}: tool_use blocks belong in assistant messages", param=bw)
                uses.append(block.id)
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
                answered.add(block.tool_use_id)
                # Each result is its own `tool` message (the Chat Completions shape every template knows),
                # kept in order with the user text around it.
                flush()
                out.append(Message("tool", [_tool_result(block, bw)]))
            elif isinstance(block, wire.ThinkingBlock):
                if msg.role == "assistant":
                    part = _thinking(block, bw, secret)
                    if part is not None:
                        pending.append(part)
            elif isinstance(block, wire.UnknownBlock):
                raise _refuse_block(block.type, bw, _DOCUMENTED_BLOCKS)
            # redacted_thinking: accepted and not rendered (this server never emits it; its data is opaque).
        flush()
        if asked:
            _unanswered(i - 1, asked, answered)
        asked = uses
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


def _user_id(metadata: wire.Metadata | None) -> tuple[str | None, dict | None]:
    """`metadata.user_id`, and the object it holds where it is JSON (Claude Code's, a string of JSON)."""
    user_id = metadata.user_id if metadata is not None else None
    if not user_id:
        return None, None
    try:
        parsed = json.loads(user_id)
    except ValueError:
        return user_id, None
    return user_id, parsed if isinstance(parsed, dict) else None


def user_key(metadata: wire.Metadata | None) -> str | None:
    """Who Claude Code runs for, the same in each of their sessions: `metadata.user_id` without its session (the
    JSON's account and device; the older `user_<hash>_account_<uuid>_session_<uuid>` before `_session_`)."""
    user_id, parsed = _user_id(metadata)
    if parsed is None:
        return user_id and user_id.split("_session_", 1)[0]
    who = [parsed.get(k) for k in ("account_uuid", "device_id")]
    return "/".join(str(w) for w in who if w) or None


def session_key(metadata: wire.Metadata | None, headers: Mapping[str, str] | None) -> str | None:
    """Claude Code's session id (header, or `metadata.user_id`'s JSON) as the sticky-routing key."""
    if headers is not None:
        sid = headers.get("x-claude-code-session-id")
        if sid:
            return sid
    user_id, parsed = _user_id(metadata)
    sid = parsed.get("session_id") if parsed is not None else None
    return sid if isinstance(sid, str) and sid else user_id


def thinking_on(req: wire.CountTokensRequest) -> bool:
    # Absent means off: a model must not think unasked (ollama#15287). between_tools is thinking off, as the API
    # defines it (the progress notes it would return as thinking blocks come back as text here).
    return req.thinking is not None and req.thinking.type in ("enabled", "adaptive")


MIN_THINKING_BUDGET = 1024
_BUDGET_DOC = "https://docs.claude.com/en/docs/build-with-claude/extended-thinking#max-tokens-and-context-window-size"


def _check_thinking_budget(req: wire.CountTokensRequest) -> None:
    """The API's rules for manual thinking, in its own words: `budget_tokens` is required, at least 1024 and below
    `max_tokens`. One exception keeps Claude Code working: with an output cap of 1024 or less no budget can meet
    both rules, and Claude Code then sends `max_tokens - 1` (CLAUDE_CODE_MAX_OUTPUT_TOKENS <= 1024 with manual
    thinking); the API refuses that, this server accepts it."""
    t = req.thinking
    if t is None or t.type != "enabled":
        return
    if t.budget_tokens is None:
        raise InvalidRequest("thinking.enabled.budget_tokens: Field required", param="thinking.budget_tokens")
    max_tokens = req.max_tokens if isinstance(req, wire.MessagesRequest) else None
    if t.budget_tokens < MIN_THINKING_BUDGET and (max_tokens is None or max_tokens > MIN_THINKING_BUDGET):
        raise InvalidRequest(f"thinking.enabled.budget_tokens: Input should be greater than or equal to "
                             f"{MIN_THINKING_BUDGET}", param="thinking.budget_tokens")
    if max_tokens is not None and t.budget_tokens >= max_tokens:
        raise InvalidRequest(f"`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our "
                             f"documentation at {_BUDGET_DOC}", param="max_tokens")


def _prefill(req: wire.CountTokensRequest, messages: list[Message]) -> bool:
    """Whether the request ends with an assistant turn to continue (the API's prefill). An empty final assistant
    message (the API allows one) is no prefill: it is dropped and the model starts a new turn. count_tokens never
    refuses one: Claude Code counts conversations that end with its own answer or tool call (`/context`), and a
    failed count only makes it estimate locally; a tail that cannot be continued is counted as a complete turn."""
    if not req.messages or req.messages[-1].role != "assistant":
        return False
    where = f"messages.{len(req.messages) - 1}"
    if not messages or messages[-1].role != "assistant":
        return False  # nothing of it renders (e.g. only unsigned thinking): a new turn
    last = messages[-1]
    if not last.parts:
        messages.pop()
        return False
    tail = last.parts[-1]
    counting = not isinstance(req, wire.MessagesRequest)
    if not isinstance(tail, TextPart):
        if counting:
            return False
        raise InvalidRequest(f"{where}: a final assistant message is continued from its text (prefill); this server "
                             f"cannot continue one that ends with a {_part_kind(tail)}", param=where)
    if tail.text != tail.text.rstrip() and not counting:
        raise InvalidRequest("messages: final assistant content cannot end with trailing whitespace", param=where)
    return True


def _part_kind(part: Part) -> str:
    return {ToolCallPart: "tool_use block", ReasoningPart: "thinking block"}.get(type(part), "non-text block")


# Request fields the current SDK can send (betas included) that ask for machinery this server does not have, where
# ignoring them would answer a different question than the one asked. Every other field is accepted; the ones
# without effect are listed, with the reason, in docs/anthropic.md.
_UNSERVED_FIELDS = {
    "compaction": "compaction requests are not supported by this server (it cannot produce a `compaction` block); "
                  "summarize the conversation with an ordinary request instead",
    "mcp_servers": "this server connects to no MCP servers; declare their tools in `tools` and run them client-side",
    "thread": "this server holds no conversation state; send the whole conversation in `messages`",
}


def _check_unserved_fields(req: wire.CountTokensRequest) -> None:
    extra = req.model_extra or {}
    for name, why in _UNSERVED_FIELDS.items():
        if name == "compaction" and not isinstance(req, wire.MessagesRequest):
            continue  # count_tokens accepts it and counts the conversation as sent, as the API does
        if extra.get(name):  # null or an empty list asks for nothing
            raise InvalidRequest(f"{name}: {why}", param=name)


def to_conversation(
    req: wire.CountTokensRequest, secret: bytes, headers: Mapping[str, str] | None = None
) -> tuple[Conversation, GenerationOptions]:
    _check_unserved_fields(req)
    _check_thinking_budget(req)
    messages = _messages(req, secret)
    continue_final = _prefill(req, messages)
    conv = Conversation(messages=messages, tools=_tools(req), tool_choice=_tool_choice(req.tool_choice))
    if thinking_on(req) and conv.tool_choice.mode in ("required", "tool"):
        # The API's rule and wording (Claude Code demotes a forced tool to auto when thinking is on).
        raise InvalidRequest("Thinking may not be enabled when tool_choice forces tool use.", param="tool_choice")
    nvext = req.nvext
    opts = GenerationOptions(
        thinking=thinking_on(req),
        reasoning_effort=req.output_config.effort if req.output_config is not None else None,
        session_key=session_key(req.metadata, headers),
        user_key=user_key(req.metadata),
        hints=agent_hints(nvext.agent_hints if nvext else None),
        forced_script=nvext.forced_script if nvext else None,
        continue_final=continue_final,
    )
    if req.output_config is not None and req.output_config.format is not None:
        opts.output_format = output_format.from_anthropic(req.output_config.format, "output_config.format")
    elif req.output_format is not None:
        opts.output_format = output_format.from_anthropic(req.output_format, "output_format")
    if isinstance(req, wire.MessagesRequest):
        if req.max_tokens < 0:
            raise InvalidRequest("max_tokens: Input should be greater than or equal to 0", param="max_tokens")
        if req.max_tokens == 0:
            _check_prewarm(req, opts)
        # Clamped by the service to what fits, never refused for size. A pre-warm prefills the prompt (prefix
        # caching keeps it) and its one token is never shown (prewarming).
        opts.max_tokens = req.max_tokens or 1
        opts.temperature = req.temperature
        opts.top_p = req.top_p
        opts.top_k = req.top_k
        opts.stop = [s for s in (req.stop_sequences or []) if s]
    return conv, opts


def thinking_omitted(req: wire.CountTokensRequest) -> bool:
    """`thinking.display: "omitted"`: thinking blocks go out without their text (their signature carries it)."""
    return thinking_on(req) and req.thinking is not None and req.thinking.display == "omitted"


FINE_GRAINED_BETA = "fine-grained-tool-streaming-2025-05-14"


def eager_tools(req: wire.CountTokensRequest, headers: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """The tools whose input streams as it is generated: each with `eager_input_streaming: true`, or every one
    (None) under the fine-grained tool streaming beta (header or `betas`). The API validates the input of the others
    before it streams it, and so does MessageEncoder: it holds such a call back until it is complete."""
    listed = (req.model_extra or {}).get("betas")
    betas = ",".join([(headers or {}).get("anthropic-beta", ""), *map(str, listed if isinstance(listed, list) else [])])
    if FINE_GRAINED_BETA in betas:
        return None
    return frozenset(t.name for t in req.tools or () if t.eager_input_streaming)


def prewarming(req: wire.CountTokensRequest) -> bool:
    """`max_tokens: 0`: the API's cache pre-warming: the prompt is processed and cached, nothing is generated."""
    return isinstance(req, wire.MessagesRequest) and req.max_tokens == 0


def _check_prewarm(req: wire.MessagesRequest, opts: GenerationOptions) -> None:
    # What the API documents as incompatible with a pre-warm: there is no answer to stream, think or shape.
    for asked, what, param in ((bool(req.stream), "streaming", "stream"), (opts.thinking, "thinking", "thinking"),
                               (opts.output_format is not None, "structured outputs", "output_config.format")):
        if asked:
            raise InvalidRequest(f"max_tokens: 0 (cache pre-warming) cannot be combined with {what}", param=param)


def messages_request(body: dict[str, Any]) -> wire.MessagesRequest:
    return parse_model(wire.MessagesRequest, body)


def count_tokens_request(body: dict[str, Any]) -> wire.CountTokensRequest:
    # count_tokens bodies may still carry max_tokens/stream (SDKs reuse the create params): ignored.
    return parse_model(wire.CountTokensRequest, body)

