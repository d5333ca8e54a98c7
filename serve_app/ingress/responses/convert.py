"""Responses request → Conversation + GenerationOptions.

Items map onto IR messages in order. Adjacent assistant-side items (assistant messages, reasoning, function and
custom tool calls) become ONE assistant turn with their parts in the order given, which is how the model produced
them (`think₀ call₀ think₁ call₁`), so the next prompt re-renders the previous turn's tokens and the prefix cache
holds. A reasoning item's text comes from its verified `encrypted_content` when present (exact), else from its
`content`, else its summary. A freeform (`custom`) tool is given to the model as a function with one string
parameter, `input`; its calls come back here as `custom_tool_call` items and are re-rendered in that shape.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from serve_app.conversation import (
    Conversation,
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
from serve_app.ingress.common import agent_hints, parse_model, thinking_switch
from serve_app.protocols.responses import (
    CustomTool,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputContent,
    MessageItem,
    NamedToolChoice,
    ReasoningItem,
    ResponsesRequest,
)

CUSTOM_PARAM = "input"
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {CUSTOM_PARAM: {"type": "string", "description": "The raw freeform input for this tool."}},
    "required": [CUSTOM_PARAM],
}


def custom_arguments(raw: str) -> str:
    """The function-style arguments a freeform call is rendered with (json.dumps default spacing, as models write)."""
    return json.dumps({CUSTOM_PARAM: raw}, ensure_ascii=False)


def _content(content: str | list[InputContent], where: str) -> list[Part]:
    if isinstance(content, str):
        return [TextPart(content)] if content else []
    parts: list[Part] = []
    for i, c in enumerate(content):
        if c.type in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            parts.append(TextPart(c.text or ""))
        elif c.type == "refusal":
            parts.append(TextPart(c.refusal or c.text or ""))
        elif c.type == "input_image":
            url = c.image_url
            if url and url.startswith("data:") and ";base64," in url:
                media, data = url[5:].split(";base64,", 1)
                parts.append(ImagePart(media_type=media or None, data=data))
            elif url:
                parts.append(ImagePart(url=url))
            else:
                raise InvalidRequest(f"{where}.{i}.image_url: field required (file ids are not supported)",
                                     param=f"{where}.{i}.image_url")
        elif c.type == "input_file":
            raise InvalidRequest(f"{where}.{i}.type: input_file is not supported", param=f"{where}.{i}.type")
        else:
            raise InvalidRequest(f"{where}.{i}.type: unsupported content type {c.type!r}", param=f"{where}.{i}.type")
    return parts


def _tool_output(output: str | list[InputContent], where: str) -> str | list[Part]:
    if isinstance(output, str):
        return output
    parts = _content(output, where)
    if all(isinstance(p, TextPart) for p in parts):
        return "".join(p.text for p in parts)  # type: ignore[union-attr]
    return parts


# -- tool types -------------------------------------------------------------------------------------------------
# What happens to a `tools[]` entry, by type: every type the current `openai` SDK's ToolParam defines (a unit test
# keeps this table equal to it, so a type the SDK gains fails CI until someone decides it here). OFFERED ones are
# given to the model; every other one is accepted and ignored, for the reason given: the model is never told of it,
# since it would call a tool nobody here executes or emit a call shape this server does not produce. A type
# outside the table is a 400 naming `tools[N].type`. docs/codex.md ("Tool types") carries `tool_types_table()`.
OFFERED_TOOLS = ("function", "custom")
_HOSTED = "hosted (OpenAI runs it on its side): "
_BUILTIN = "built-in (the model calls it with `{}` items, which this server never produces): "
TOOL_TYPES: dict[str, str] = {
    "function": "given to the model as it is; its calls come back as `function_call` items",
    "custom": (f"given to the model as a function with one string parameter, `{CUSTOM_PARAM}` (a grammar in "
               "`format` is added to its description); its calls come back as `custom_tool_call` items"),
    "file_search": _HOSTED + "this server keeps no vector stores",
    **dict.fromkeys(("web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11"),
                    _HOSTED + "this server has no web access"),
    "code_interpreter": _HOSTED + "this server runs no code containers",
    "image_generation": _HOSTED + "this server serves text models only",
    "mcp": _HOSTED + "this server makes no outbound MCP connections; give MCP tools as function tools, as Codex does",
    "programmatic_tool_calling": _HOSTED + "this server runs no model-written programs",
    "tool_search": ("hosted (OpenAI runs the search) or, with `execution: \"client\"`, built-in (the model calls "
                    "it with `tool_search_call` items, which this server never produces): function tools marked "
                    "`defer_loading` are given to the model up front instead"),
    "local_shell": (_BUILTIN.format("local_shell_call") + "Codex sends it only for a model profile with "
                    "`shell_type: local`; the catalog `codex-config` writes says `shell_command`, so Codex's shell "
                    "arrives as a function tool, which is offered"),
    "shell": _BUILTIN.format("shell_call") + "Codex's shell arrives as a function tool here (see `local_shell`)",
    "apply_patch": (_BUILTIN.format("apply_patch_call") + "Codex's apply_patch arrives as a `custom` tool under the "
                    "catalog's `apply_patch_tool_type: freeform`, which is offered"),
    **dict.fromkeys(("computer", "computer_use_preview"), _BUILTIN.format("computer_call")
                    + "the served models are not trained for its screenshot loop"),
    "namespace": ("its member tools' calls carry a `namespace` field this server does not produce (and members may "
                  "be deferred behind `tool_search`); send them as top-level function or custom tools"),
}
assert set(OFFERED_TOOLS) <= set(TOOL_TYPES)


def tool_types_table() -> str:
    """The Markdown table docs/codex.md carries (a unit test keeps the two equal)."""
    rows = ["| `tools[].type` | Here | Why |", "|---|---|---|"]
    for t, why in TOOL_TYPES.items():
        rows.append(f"| `{t}` | {'offered to the model' if t in OFFERED_TOOLS else 'accepted, ignored'} | {why} |")
    return "\n".join(rows)


def offered_tools(tools: list[Any]) -> list[FunctionTool | CustomTool]:
    """The tools the model is told of; any other type in the table is dropped here, on purpose (TOOL_TYPES)."""
    for i, t in enumerate(tools):
        if t.type not in TOOL_TYPES:
            param = f"tools[{i}].type"
            supported = ", ".join(f"'{k}'" for k in TOOL_TYPES)
            raise InvalidRequest(f"{param}: Invalid value: '{t.type}'. Supported values are: {supported}.",
                                 param=param, code="invalid_value")
    return [t for t in tools if t.type in OFFERED_TOOLS]


def _tool_spec(tool: FunctionTool | CustomTool) -> ToolSpec:
    if isinstance(tool, CustomTool):
        desc = tool.description or ""
        fmt = tool.format or {}
        if fmt.get("type") == "grammar" and fmt.get("definition"):
            desc += (f"\n\nPass the raw input as the `{CUSTOM_PARAM}` string; it must match this "
                     f"{fmt.get('syntax', 'lark')} grammar:\n{fmt['definition']}")
        return ToolSpec(name=tool.name, description=desc, parameters=CUSTOM_PARAMETERS, kind="custom")
    return ToolSpec(name=tool.name, description=tool.description or "",
                    parameters=tool.parameters or {"type": "object", "properties": {}})


def _allowed_names(tc: NamedToolChoice, kinds: dict[str, str], types: set[str]) -> tuple[str, ...]:
    """The offered tools an `allowed_tools` choice lists. A function or custom entry must name a tool of its type in
    `tools`; any other entry (a hosted tool's type) must be a type in `tools`, and allows nothing: the model is never
    told of such a tool (TOOL_TYPES)."""
    if tc.mode not in ("auto", "required"):
        raise InvalidRequest(f"tool_choice.mode: Invalid value: {tc.mode!r}. Supported values are: 'auto' and "
                             "'required'.", param="tool_choice.mode", code="invalid_value")
    if tc.tools is None:
        raise InvalidRequest("tool_choice.tools: field required", param="tool_choice.tools")
    allowed: list[str] = []
    for i, entry in enumerate(tc.tools):
        where = f"tool_choice.tools[{i}]"
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind in OFFERED_TOOLS:
            name = entry.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequest(f"{where}.name: field required", param=f"{where}.name")
            if kinds.get(name) != kind:
                raise InvalidRequest(f"{where}.name: no {kind} tool named {name!r} in tools", param=f"{where}.name")
            allowed.append(name)
        elif kind not in types:
            raise InvalidRequest(f"{where}.type: no tool of type {kind!r} in tools", param=f"{where}.type")
    return tuple(dict.fromkeys(allowed))


def _tool_choice(req: ResponsesRequest, tools: list[ToolSpec]) -> ToolChoice:
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    tc = req.tool_choice
    if tc is None or tc == "auto":
        return ToolChoice("auto", parallel=parallel)
    if tc in ("none", "required"):
        return ToolChoice(tc, parallel=parallel)  # type: ignore[arg-type]
    assert isinstance(tc, NamedToolChoice)
    if tc.type in ("function", "custom"):
        if not tc.name:
            raise InvalidRequest("tool_choice.name: field required", param="tool_choice.name")
        if tc.name not in {t.name for t in tools}:
            raise InvalidRequest(f"tool_choice.name: no tool named {tc.name!r} in tools", param="tool_choice.name")
        return ToolChoice("tool", name=tc.name, parallel=parallel)
    if tc.type == "allowed_tools":
        # every tool stays in the prompt (the cached prefix does not change); the grammar allows only these calls
        allowed = _allowed_names(tc, {t.name: t.kind for t in tools}, {t.type for t in req.tools})
        return ToolChoice(tc.mode, parallel=parallel, allowed=allowed)  # type: ignore[arg-type]
    return ToolChoice("auto", parallel=parallel)  # a hosted tool's type: the model is never told of such a tool


# -- input item types -------------------------------------------------------------------------------------------
# Every input item type the API documents (the current `openai` SDK's ResponseInputItemParam; a unit test keeps
# the list equal to it): the list the 400 for an unknown type names. The ones items_to_messages renders are
# HANDLED_ITEMS; every other one is refused with a 400 naming it and its index, never dropped, because dropping it
# would hide part of the conversation from the model (docs/codex.md, "What the Responses endpoint does").
DOCUMENTED_ITEMS = (
    "additional_tools", "apply_patch_call", "apply_patch_call_output", "code_interpreter_call", "compaction",
    "compaction_trigger", "computer_call", "computer_call_output", "configuration_update", "custom_tool_call",
    "custom_tool_call_output", "file_search_call", "function_call", "function_call_output", "image_generation_call",
    "item_reference", "local_shell_call", "local_shell_call_output", "mcp_approval_request", "mcp_approval_response",
    "mcp_call", "mcp_list_tools", "message", "program", "program_output", "reasoning", "shell_call",
    "shell_call_output", "tool_search_call", "tool_search_output", "web_search_call",
)
HANDLED_ITEMS = ("message", "reasoning", "function_call", "function_call_output", "custom_tool_call",
                 "custom_tool_call_output")
# Why each refused one cannot be served: they record work of tools this server does not run or offer (hosted tools
# run by OpenAI; built-in client tools it never gives the model, so it never produced their calls), or name state
# kept on OpenAI's side.
_HOSTED = "this server runs no hosted tools (web and file search, code interpreter, image generation, MCP, tool search)"
_BUILTIN = ("this server offers no built-in computer, shell, local_shell or apply_patch tool, so it produced no such "
            "call; give the model function or custom tools")
_STATE = "this server keeps no items, compactions or configuration of its own; send the history itself in `input`"
_REFUSED_WHY = {
    **dict.fromkeys(("code_interpreter_call", "file_search_call", "image_generation_call", "mcp_approval_request",
                     "mcp_approval_response", "mcp_call", "mcp_list_tools", "tool_search_call", "tool_search_output",
                     "additional_tools", "web_search_call", "program", "program_output"), _HOSTED),
    **dict.fromkeys(("apply_patch_call", "apply_patch_call_output", "computer_call", "computer_call_output",
                     "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output"), _BUILTIN),
    **dict.fromkeys(("compaction", "compaction_trigger", "configuration_update", "item_reference"), _STATE),
}


def refuse_item(item_type: str, at: str) -> InvalidRequest:
    """The 400 for an input item this server does not render: `at` is its place, as OpenAI names it (`input[3]`)."""
    param = f"{at}.type"
    if item_type in DOCUMENTED_ITEMS:
        return InvalidRequest(f"{param}: `{item_type}` items are not supported by this server "
                              f"({_REFUSED_WHY[item_type]})", param=param, code="unsupported_value")
    supported = ", ".join(f"'{t}'" for t in DOCUMENTED_ITEMS)
    return InvalidRequest(f"{param}: Invalid value: '{item_type}'. Supported values are: {supported}.",
                          param=param, code="invalid_value")


def reasoning_text(item: ReasoningItem, where: str, open_sealed: Callable[[str, str], str] | None) -> str:
    if item.encrypted_content:
        if open_sealed is None:
            raise InvalidRequest(f"{where}.encrypted_content: encrypted reasoning is not accepted by this server",
                                 param=f"{where}.encrypted_content")
        return open_sealed(item.encrypted_content, f"{where}.encrypted_content")
    if item.content:
        return "".join(c.text for c in item.content)
    return "".join(s.text for s in item.summary)


def items_to_messages(
    items: list[Any],
    open_sealed: Callable[[str, str], str] | None = None,
    *,
    where: str = "input",
) -> list[Message]:
    messages: list[Message] = []
    call_names: dict[str, str] = {}

    def assistant() -> Message:
        if messages and messages[-1].role == "assistant":
            return messages[-1]
        messages.append(Message("assistant", []))
        return messages[-1]

    for i, item in enumerate(items):
        at = f"{where}.{i}"
        if isinstance(item, MessageItem):
            parts = _content(item.content, f"{at}.content")
            if item.role == "assistant":
                assistant().parts.extend(parts)
            else:
                messages.append(Message(item.role, parts))
        elif isinstance(item, ReasoningItem):
            text = reasoning_text(item, at, open_sealed)
            if text:
                assistant().parts.append(ReasoningPart(text, signature=item.encrypted_content))
        elif isinstance(item, FunctionCallItem):
            call_names[item.call_id] = item.name
            assistant().parts.append(ToolCallPart(id=item.call_id, name=item.name, arguments=item.arguments))
        elif isinstance(item, CustomToolCallItem):
            call_names[item.call_id] = item.name
            assistant().parts.append(ToolCallPart(id=item.call_id, name=item.name,
                                                  arguments=custom_arguments(item.input), kind="custom"))
        elif isinstance(item, (FunctionCallOutputItem, CustomToolCallOutputItem)):
            messages.append(Message("tool", [ToolResultPart(
                tool_call_id=item.call_id,
                content=_tool_output(item.output, f"{at}.output"),
                name=call_names.get(item.call_id),
            )]))
        else:  # an OtherItem: a type no branch above renders
            raise refuse_item(item.type, f"{where}[{i}]")
    return messages


# Fields of the current SDK's create() that refer to server-side objects this server does not keep: ignoring them
# would answer without the input they stand for. Every other field is accepted (docs/anthropic.md, "OpenAI APIs").
_UNSERVED_FIELDS = {
    "conversation": "this server keeps no conversation objects; send the history in `input` (or use "
                    "`previous_response_id` with `store`)",
    "prompt": "this server keeps no prompt templates; send the prompt in `instructions` and `input`",
}


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Validate a request body; errors name the offending field (`input.3.call_id`), as a 400."""
    req = parse_model(ResponsesRequest, body)
    extra = req.model_extra or {}
    for name, why in _UNSERVED_FIELDS.items():
        if extra.get(name):
            raise InvalidRequest(f"{name}: {why}", param=name)
    return req


def responses_to_conversation(
    req: ResponsesRequest,
    open_sealed: Callable[[str, str], str] | None = None,
    history: list[Any] | None = None,
) -> tuple[Conversation, GenerationOptions]:
    """`history`: the parsed items of the `previous_response_id` chain (its inputs and outputs), prepended."""
    messages: list[Message] = []
    if req.instructions:
        messages.append(Message("system", [TextPart(req.instructions)]))
    if history:
        messages.extend(items_to_messages(history, open_sealed, where="previous_response"))
    items: list[Any] = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    current = items_to_messages(items, open_sealed)
    if messages and current and messages[-1].role == "assistant" and current[0].role == "assistant":
        messages[-1].parts.extend(current[0].parts)  # the previous output continues into this input's items
        current = current[1:]
    messages.extend(current)

    tools = [_tool_spec(t) for t in offered_tools(req.tools)]
    conv = Conversation(messages=messages, tools=tools, tool_choice=_tool_choice(req, tools))

    effort = req.reasoning.effort if req.reasoning else None
    kwargs = dict(req.chat_template_kwargs or {})
    thinking = thinking_switch(kwargs, None if effort is None else effort != "none")  # vLLM's order
    nvext = req.nvext
    opts = GenerationOptions(
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        thinking=thinking,
        reasoning_effort=effort,
        chat_template_kwargs=kwargs,
        session_key=req.prompt_cache_key or req.user,
        user_key=req.safety_identifier or req.user,
        hints=agent_hints(nvext.agent_hints if nvext else None),
        forced_script=nvext.forced_script if nvext else None,
        output_format=output_format.from_responses(req.text.format if req.text else None),
    )
    return conv, opts


def custom_tool_names(req: ResponsesRequest) -> frozenset[str]:
    return frozenset(t.name for t in req.tools if isinstance(t, CustomTool))


def echo_fields(req: ResponsesRequest) -> dict[str, Any]:
    """Request parameters the response object repeats back."""
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                      "summary": req.reasoning.summary if req.reasoning else None},
        "service_tier": req.service_tier or "default",
        "store": True if req.store is None else req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"}),
                 **({"verbosity": req.text.verbosity} if req.text and req.text.verbosity else {})},
        "tool_choice": (req.tool_choice.model_dump(exclude_none=True)
                        if isinstance(req.tool_choice, NamedToolChoice) else (req.tool_choice or "auto")),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "safety_identifier": req.safety_identifier,
    }
