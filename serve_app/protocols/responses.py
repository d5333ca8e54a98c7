"""OpenAI Responses API request wire model (what Codex CLI and the `openai` SDK send).

Permissive about unknown fields (newer Codex builds add `client_metadata`, `service_tier`, ... — they must be
ignored), strict about the types of the fields we use. Input items are a discriminated union on `type`; an item of
any other type parses as `OtherItem`, which the converter refuses with a 400 naming its type and index
(ingress/responses/convert.py, `refuse_item`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, TypeAdapter

from serve_app.protocols.base import OpenModel
from serve_app.protocols.tags import type_discriminator


# -- content parts ---------------------------------------------------------------------------------------------


class InputContent(OpenModel):
    """input_text / output_text / input_image / refusal / input_file: one model, dispatched on `type`."""

    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    refusal: str | None = None


# -- input items -----------------------------------------------------------------------------------------------


class MessageItem(OpenModel):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[InputContent]]
    status: str | None = None
    phase: str | None = None


class SummaryText(OpenModel):
    type: str = "summary_text"
    text: str = ""


class ReasoningText(OpenModel):
    type: str = "reasoning_text"
    text: str = ""


class ReasoningItem(OpenModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class FunctionCallItem(OpenModel):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str
    status: str | None = None


class FunctionCallOutputItem(OpenModel):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: Union[str, list[InputContent]]


class CustomToolCallItem(OpenModel):
    type: Literal["custom_tool_call"]
    id: str | None = None
    call_id: str
    name: str
    input: str
    status: str | None = None


class CustomToolCallOutputItem(OpenModel):
    type: Literal["custom_tool_call_output"]
    id: str | None = None
    call_id: str
    output: Union[str, list[InputContent]]


class OtherItem(OpenModel):
    """Any other item type (web_search_call, local_shell_call, compaction, item_reference, ...): parsed so that the
    converter can refuse it by name, with its index."""

    type: str


_KNOWN = {"message", "reasoning", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output"}


_item_tag = type_discriminator(_KNOWN, "other", missing="message")  # an item without `type` is a message


InputItem = Annotated[
    Union[
        Annotated[MessageItem, Tag("message")],
        Annotated[ReasoningItem, Tag("reasoning")],
        Annotated[FunctionCallItem, Tag("function_call")],
        Annotated[FunctionCallOutputItem, Tag("function_call_output")],
        Annotated[CustomToolCallItem, Tag("custom_tool_call")],
        Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")],
        Annotated[OtherItem, Tag("other")],
    ],
    Discriminator(_item_tag),
]


# -- tools -----------------------------------------------------------------------------------------------------


class FunctionTool(OpenModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomTool(OpenModel):
    """A freeform tool (Codex's apply_patch): the model's input is raw text, optionally constrained by a grammar."""

    type: Literal["custom"]
    name: str
    description: str | None = None
    format: dict[str, Any] | None = None


class OtherTool(OpenModel):
    """Any other tool type: accepted and ignored, or a 400 if the SDK has no such type (convert.py, TOOL_TYPES)."""

    type: str


_tool_tag = type_discriminator(("function", "custom"), "other")


ToolDef = Annotated[
    Union[
        Annotated[FunctionTool, Tag("function")],
        Annotated[CustomTool, Tag("custom")],
        Annotated[OtherTool, Tag("other")],
    ],
    Discriminator(_tool_tag),
]


class NamedToolChoice(OpenModel):
    type: str  # function | custom | allowed_tools | a hosted tool's type
    name: str | None = None
    mode: str | None = None  # allowed_tools: auto | required
    tools: list[dict[str, Any]] | None = None  # allowed_tools: the tools the model may call


# -- request ---------------------------------------------------------------------------------------------------


class ReasoningParam(OpenModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None


class TextParam(OpenModel):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class NvExt(OpenModel):
    agent_hints: dict[str, Any] | None = None
    forced_script: str | None = None


class ResponsesRequest(OpenModel):
    model: str
    input: Union[str, list[InputItem]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[ToolDef] = Field(default_factory=list)
    tool_choice: Union[Literal["auto", "none", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningParam | None = None
    text: TextParam | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    store: bool | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    previous_response_id: str | None = None
    user: str | None = None
    safety_identifier: str | None = None  # `user`'s successor in OpenAI's API
    truncation: str | None = None
    service_tier: str | None = None
    # vLLM's extension, as on Chat Completions: kwargs for the chat template (enable_thinking over reasoning.effort)
    # and for the parsers (force_nonempty_content)
    chat_template_kwargs: dict[str, Any] | None = None
    nvext: NvExt | None = None

    def wants_encrypted_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or [])


# The items of a stored response (`previous_response_id`) are parsed back with this, the request's own item union.
INPUT_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])
