"""Responses `tools[]` types: each one the installed `openai` SDK defines is either offered to the model or accepted
and ignored for a documented reason (TOOL_TYPES); a type the SDK does not define is a 400 naming `tools[N].type`.

The request bodies are built with the SDK's own tool param types, so a field a client can send is a field tested
here; the routes are the real FastAPI app over ASGI with the stand-in service of test_responses_routes."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from openai.types.responses import (
    ApplyPatchToolParam,
    ComputerToolParam,
    ComputerUsePreviewToolParam,
    CustomToolParam,
    FileSearchToolParam,
    FunctionShellToolParam,
    FunctionToolParam,
    NamespaceToolParam,
    ToolParam,
    ToolSearchToolParam,
    WebSearchPreviewToolParam,
    WebSearchToolParam,
)
from openai.types.responses.tool_param import CodeInterpreter, ImageGeneration, LocalShell, Mcp, ProgrammaticToolCalling

from serve_app.errors import ServiceError
from serve_app.ingress.responses.convert import (
    OFFERED_TOOLS,
    TOOL_TYPES,
    parse_responses_request,
    responses_to_conversation,
    tool_types_table,
)

CODEX_DOC = Path(__file__).resolve().parents[2] / "docs" / "codex.md"
MARK = "zq-ignored-tool-mark"  # in every ignored tool's own text: it must not reach the conversation


def _literals(t) -> list[str]:
    if typing.get_origin(t) is typing.Literal:
        return list(typing.get_args(t))
    return [v for a in typing.get_args(t) for v in _literals(a)]


def sdk_tool_types() -> set[str]:
    """Every `type` value of the SDK's ToolParam union (some members allow several, e.g. dated web_search names)."""
    return {v for m in typing.get_args(ToolParam) for v in _literals(typing.get_type_hints(m)["type"])}


FUNCTION = FunctionToolParam(type="function", name="exec_command", description="Run a command.", strict=False,
                             parameters={"type": "object", "properties": {"cmd": {"type": "string"}}})

# One tool of each type the SDK defines, as a client would send it (the Codex shapes of harness-contracts B5 where
# Codex sends them). Dated type names use the same param class as their undated name.
SDK_TOOLS: dict[str, ToolParam] = {
    "function": FUNCTION,
    "custom": CustomToolParam(type="custom", name="apply_patch", description="Patch files.",
                              format={"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}),
    "file_search": FileSearchToolParam(type="file_search", vector_store_ids=[f"vs_{MARK}"], max_num_results=3),
    "web_search": WebSearchToolParam(type="web_search", search_context_size="low",
                                     filters={"allowed_domains": [f"{MARK}.example"]}),
    "web_search_2025_08_26": WebSearchToolParam(type="web_search_2025_08_26",
                                                filters={"allowed_domains": [f"{MARK}.example"]}),
    "web_search_preview": WebSearchPreviewToolParam(type="web_search_preview",
                                                    user_location={"type": "approximate", "city": MARK}),
    "web_search_preview_2025_03_11": WebSearchPreviewToolParam(type="web_search_preview_2025_03_11",
                                                               user_location={"type": "approximate", "city": MARK}),
    "code_interpreter": CodeInterpreter(type="code_interpreter", container={"type": "auto", "file_ids": [MARK]}),
    "image_generation": ImageGeneration(type="image_generation", size="1024x1024", model=MARK),
    "mcp": Mcp(type="mcp", server_label=MARK, server_url="https://mcp.example/sse", require_approval="never"),
    "programmatic_tool_calling": ProgrammaticToolCalling(type="programmatic_tool_calling"),
    "tool_search": ToolSearchToolParam(type="tool_search", execution="client", description=MARK,
                                       parameters={"type": "object", "properties": {"q": {"type": "string"}}}),
    "local_shell": LocalShell(type="local_shell"),
    "shell": FunctionShellToolParam(type="shell", environment={"type": "local"}),
    "apply_patch": ApplyPatchToolParam(type="apply_patch"),
    "computer": ComputerToolParam(type="computer"),
    "computer_use_preview": ComputerUsePreviewToolParam(type="computer_use_preview", display_width=1024,
                                                        display_height=768, environment="linux"),
    "namespace": NamespaceToolParam(type="namespace", name="crm", description=MARK, tools=[
        {"type": "function", "name": f"lookup_{MARK}", "parameters": {"type": "object", "properties": {}}}]),
}
IGNORED = sorted(set(TOOL_TYPES) - set(OFFERED_TOOLS))


def convert(tools: list) -> tuple:
    req = parse_responses_request({"model": "m", "input": "list the files", "tools": tools, "tool_choice": "auto"})
    return responses_to_conversation(req)


def test_every_sdk_tool_type_is_classified():
    """A type the SDK gains fails here until someone decides it: offered, or ignored with a reason (TOOL_TYPES)."""
    sdk = sdk_tool_types()
    assert set(TOOL_TYPES) == sdk, (f"unclassified: {sorted(sdk - set(TOOL_TYPES))}, "
                                    f"gone from the SDK: {sorted(set(TOOL_TYPES) - sdk)}")
    assert set(SDK_TOOLS) == sdk  # and each has a body below
    # The Codex types of harness-contracts B5 are all in the SDK, so all classified.
    assert {"function", "custom", "local_shell", "web_search", "tool_search", "image_generation", "namespace"} <= sdk


def test_the_docs_carry_the_table():
    assert tool_types_table() in CODEX_DOC.read_text(), "docs/codex.md: paste tool_types_table() into 'Tool types'"


def test_the_offered_types_reach_the_model():
    conv, _ = convert([SDK_TOOLS["function"], SDK_TOOLS["custom"]])
    assert [(t.name, t.kind) for t in conv.tools] == [("exec_command", "function"), ("apply_patch", "custom")]
    assert conv.tools[0].parameters == FUNCTION["parameters"]


@pytest.mark.parametrize("tool_type", IGNORED)
def test_an_ignored_type_is_accepted_and_never_reaches_the_model(tool_type):
    """The conversation (all a prompt is rendered from) is the one without the ignored tool, wherever it sits."""
    tool = SDK_TOOLS[tool_type]
    assert tool["type"] == tool_type
    baseline = convert([FUNCTION])
    for tools in ([tool, FUNCTION], [FUNCTION, tool]):
        assert convert(tools) == baseline
    conv, _ = convert([tool])
    assert conv.tools == [] and MARK not in repr(conv)


def test_all_the_sdk_types_at_once_offer_only_function_and_custom():
    conv, _ = convert(list(SDK_TOOLS.values()))
    assert [t.name for t in conv.tools] == ["exec_command", "apply_patch"] and MARK not in repr(conv)


@pytest.mark.parametrize("bad,shown", [({"type": "telepathy"}, "telepathy"),
                                       ({"type": "Function", "name": "f"}, "Function"),
                                       ({"type": "local_shell_call"}, "local_shell_call")])
def test_a_type_the_sdk_does_not_define_is_a_400_naming_its_index(bad, shown):
    with pytest.raises(ServiceError) as e:
        convert([FUNCTION, SDK_TOOLS["web_search"], bad])
    err = e.value
    assert err.status == 400 and err.param == "tools[2].type" and err.code == "invalid_value"
    assert f"Invalid value: '{shown}'" in err.message and "'local_shell'" in err.message


def test_required_with_only_ignored_tools_is_the_tool_choice_400():
    """No call could satisfy it: the service refuses it (service.prepare → check_choice), as docs/codex.md says."""
    from serve_app.parsers.tool_grammar import check_choice

    req = parse_responses_request({"model": "m", "input": "hi", "tool_choice": "required",
                                   "tools": [SDK_TOOLS["web_search"], SDK_TOOLS["local_shell"]]})
    conv, _ = responses_to_conversation(req)
    assert conv.tools == [] and check_choice(conv.tool_choice, conv.tools) == (
        "tool_choice requires a tool call, but no tools were given")
