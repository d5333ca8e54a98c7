"""OpenAI Responses API request wire model (what Codex CLI and the `openai` SDK send).

Permissive about unknown fields (newer Codex builds add `client_metadata`, `service_tier`, ... — they must be
ignored), strict about the types of the fields we use. Input items are a discriminated union on `type`; item
types we cannot use (web_search_call, compaction, ...) are accepted and dropped by the converter.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from serve_app.protocols.tags import type_discriminator


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- content parts ---------------------------------------------------------------------------------------------


class InputContent(_Open):
    """input_text / output_text / input_image / refusal / input_file: one model, dispatched on `type`."""

    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None
    refusal: str | None = None


# -- input items -----------------------------------------------------------------------------------------------


class MessageItem(_Open):
    type: Literal["message"] = "message"
    id: str | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[InputContent]]
    status: str | None = None
    phase: str | None = None


class SummaryText(_Open):
    type: str = "summary_text"
    text: str = ""


class ReasoningText(_Open):
    type: str = "reasoning_text"
    text: str = ""


class ReasoningItem(_Open):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class FunctionCallItem(_Open):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str
    status: str | None = None


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    id: str | None = None
    call_id: str
    output: Union[str, list[InputContent]]


class CustomToolCallItem(_Open):
    type: Literal["custom_tool_call"]
    id: str | None = None
    call_id: str
    name: str
    input: str
    status: str | None = None


class CustomToolCallOutputItem(_Open):
    type: Literal["custom_tool_call_output"]
    id: str | None = None
    call_id: str
    output: Union[str, list[InputContent]]


class OtherItem(_Open):
    """Item types we accept and ignore (web_search_call, local_shell_call, compaction, item_reference, ...)."""

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


class FunctionTool(_Open):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomTool(_Open):
    """A freeform tool (Codex's apply_patch): the model's input is raw text, optionally constrained by a grammar."""

    type: Literal["custom"]
    name: str
    description: str | None = None
    format: dict[str, Any] | None = None


class OtherTool(_Open):
    type: str  # local_shell, web_search, tool_search, image_generation, namespace, ...


_tool_tag = type_discriminator(("function", "custom"), "other")


ToolDef = Annotated[
    Union[
        Annotated[FunctionTool, Tag("function")],
        Annotated[CustomTool, Tag("custom")],
        Annotated[OtherTool, Tag("other")],
    ],
    Discriminator(_tool_tag),
]


class NamedToolChoice(_Open):
    type: str  # function | custom | allowed_tools | ...
    name: str | None = None


# -- request ---------------------------------------------------------------------------------------------------


class ReasoningParam(_Open):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None


class TextParam(_Open):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class NvExt(_Open):
    agent_hints: dict[str, Any] | None = None
    forced_script: str | None = None


class ResponsesRequest(_Open):
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
    truncation: str | None = None
    service_tier: str | None = None
    nvext: NvExt | None = None

    def wants_encrypted_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or [])


_ITEMS_ADAPTER = None


def _clean_loc(loc: tuple) -> str:
    """`input.0.function_call.call_id` → `input.0.call_id`: drop the union tag pydantic puts after an index."""
    out: list[str] = []
    skip_tag = False
    for p in loc:
        if skip_tag and isinstance(p, str) and (p in _KNOWN or p in ("other", "function", "custom")):
            skip_tag = False
            continue
        skip_tag = isinstance(p, int)
        out.append(str(p))
    return ".".join(out)


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Validate a request body; errors name the offending field (`input.3.call_id`), as a 400."""
    from pydantic import TypeAdapter, ValidationError

    from serve_app.errors import InvalidRequest

    global _ITEMS_ADAPTER
    try:
        return ResponsesRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        if isinstance(body, dict) and isinstance(body.get("input"), list) and err["loc"][:1] == ("input",):
            # `input` is str | list: report the list branch's error, not "input: should be a valid string".
            if _ITEMS_ADAPTER is None:
                _ITEMS_ADAPTER = TypeAdapter(list[InputItem])
            try:
                _ITEMS_ADAPTER.validate_python(body["input"])
            except ValidationError as e2:
                err = e2.errors()[0]
                err = {**err, "loc": ("input", *err["loc"])}
        loc = _clean_loc(tuple(err.get("loc", ())))
        msg = "field required" if err.get("type") == "missing" else err.get("msg", "invalid value")
        raise InvalidRequest(f"{loc}: {msg}" if loc else msg, param=loc or None) from None
