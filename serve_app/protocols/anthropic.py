"""Anthropic Messages API wire models (request side).

Permissive where Claude Code and OpenClaw send extras (harness-contracts A3): unknown top-level fields, unknown
block keys, `cache_control` on any block or tool and extra tool keys are accepted. Strict on types: a field that is
present must have the right type, and a wrong one becomes a 400 naming it. A block whose `type` is not modelled
here parses as `UnknownBlock` so that the adapter can refuse it with the API's own wording (never drop it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag

from serve_app.protocols.base import OpenModel
from serve_app.protocols.tags import type_discriminator


class CacheControl(OpenModel):
    type: str = "ephemeral"
    ttl: str | None = None


class Base64Source(OpenModel):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSource(OpenModel):
    type: Literal["url"]
    url: str


class TextSource(OpenModel):
    type: Literal["text"]
    media_type: str | None = None
    data: str


class ContentSource(OpenModel):
    type: Literal["content"]
    content: str | list[dict[str, Any]]


class FileSource(OpenModel):
    type: Literal["file"]
    file_id: str


ImageSource = Annotated[Union[Base64Source, UrlSource, FileSource], Field(discriminator="type")]
DocumentSource = Annotated[
    Union[Base64Source, UrlSource, TextSource, ContentSource, FileSource], Field(discriminator="type")
]


class TextBlock(OpenModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ImageBlock(OpenModel):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


class DocumentBlock(OpenModel):
    type: Literal["document"]
    source: DocumentSource
    title: str | None = None
    context: str | None = None
    cache_control: CacheControl | None = None


class ToolUseBlock(OpenModel):
    type: Literal["tool_use", "server_tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)
    cache_control: CacheControl | None = None


class SearchResultBlock(OpenModel):
    type: Literal["search_result"]
    source: str
    title: str
    content: list[TextBlock]
    citations: dict[str, Any] | None = None  # accepted; this server never cites
    cache_control: CacheControl | None = None


class UnknownBlock(OpenModel):
    """A block type this server does not model: the adapter refuses it with a 400 naming the type."""

    type: str


_result_block_tag = type_discriminator(("text", "image", "document", "search_result"), "unknown")


ToolResultContentBlock = Annotated[
    Union[
        Annotated[TextBlock, Tag("text")],
        Annotated[ImageBlock, Tag("image")],
        Annotated[DocumentBlock, Tag("document")],
        Annotated[SearchResultBlock, Tag("search_result")],
        Annotated[UnknownBlock, Tag("unknown")],
    ],
    Discriminator(_result_block_tag),
]


class ToolResultBlock(OpenModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ToolResultContentBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(OpenModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # accepted when absent/empty (harness-contracts E); verified when present
    cache_control: CacheControl | None = None


class RedactedThinkingBlock(OpenModel):
    type: Literal["redacted_thinking"]
    data: str
    cache_control: CacheControl | None = None


_block_tag = type_discriminator(
    ("text", "image", "document", "search_result", "tool_use", "tool_result", "thinking", "redacted_thinking"),
    "unknown",
    aliases={"server_tool_use": "tool_use"},
)


ContentBlock = Annotated[
    Union[
        Annotated[TextBlock, Tag("text")],
        Annotated[ImageBlock, Tag("image")],
        Annotated[DocumentBlock, Tag("document")],
        Annotated[SearchResultBlock, Tag("search_result")],
        Annotated[ToolUseBlock, Tag("tool_use")],
        Annotated[ToolResultBlock, Tag("tool_result")],
        Annotated[ThinkingBlock, Tag("thinking")],
        Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
        Annotated[UnknownBlock, Tag("unknown")],
    ],
    Discriminator(_block_tag),
]


class InputMessage(OpenModel):
    # "system" inside messages: Claude Code's mid-conversation-system beta (harness-contracts A3).
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class SystemBlock(OpenModel):
    type: Literal["text"] = "text"
    text: str
    cache_control: CacheControl | None = None


class Tool(OpenModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # absent on server tools (web_search_…), refused with a clear 400
    type: str | None = None  # "custom" or absent for client tools; a dated type for server tools
    cache_control: CacheControl | None = None
    eager_input_streaming: bool | None = None  # stream this tool's input as generated (fine-grained streaming)


class ToolChoiceSpec(OpenModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(OpenModel):
    # between_tools: the 2026 SDK's "thinking off, progress notes between tool calls as thinking blocks"; served as
    # thinking off (docs/anthropic.md).
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: str | None = None  # "omitted": text sealed in the signature instead; "summarized": in full (docs)


class OutputConfig(OpenModel):
    effort: str | None = None
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": {...}}: the answer's text must match


class Metadata(OpenModel):
    user_id: str | None = None


class Nvext(OpenModel):
    forced_script: str | None = None
    agent_hints: dict[str, Any] | None = None


class CountTokensRequest(OpenModel):
    model: str
    messages: list[InputMessage]
    system: str | list[SystemBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceSpec | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's spelling of output_config.format
    metadata: Metadata | None = None
    nvext: Nvext | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stream: bool | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's own range
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
