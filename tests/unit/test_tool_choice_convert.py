"""OpenAI tool choices beyond the plain modes, converted from bodies built with the `openai` SDK's own param types:
`allowed_tools` on Chat Completions and Responses (every tool stays in the prompt, the grammar lets the model call
only the listed ones), and Chat's `custom` choice, which this server refuses with a 400 that says why."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import (
    ChatCompletionAllowedToolChoiceParam,
    ChatCompletionAllowedToolsParam,
    ChatCompletionCustomToolParam,
    ChatCompletionFunctionToolParam,
    ChatCompletionNamedToolChoiceCustomParam,
)
from openai.types.chat.completion_create_params import CompletionCreateParamsNonStreaming
from openai.types.responses import CustomToolParam, FunctionToolParam, ToolChoiceAllowedParam, WebSearchToolParam
from openai.types.responses.response_create_params import ResponseCreateParamsNonStreaming

from serve_app.conversation import GenerationOptions, ToolChoice
from serve_app.errors import InvalidRequest
from serve_app.ingress.chat.convert import chat_request_to_conversation
from serve_app.ingress.responses.convert import echo_fields, parse_responses_request, responses_to_conversation
from serve_app.parsers.tool_grammar import check_choice, structural_tag
from test_prompt_render import renderer, tok  # noqa: F401 - tok is the renderer's tokenizer fixture

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def chat_tool(name: str) -> ChatCompletionFunctionToolParam:
    return {"type": "function", "function": {"name": name, "description": f"{name} of a city", "parameters": CITY}}


def chat_allowed(mode, *names: str) -> ChatCompletionAllowedToolChoiceParam:
    tools: ChatCompletionAllowedToolsParam = {
        "mode": mode, "tools": [{"type": "function", "function": {"name": n}} for n in names]}
    return {"type": "allowed_tools", "allowed_tools": tools}


def chat(tool_choice=None, tools=("get_weather", "get_time", "get_news"), **kw):
    body: CompletionCreateParamsNonStreaming = {
        "model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}],
        "tools": [chat_tool(n) for n in tools], **kw}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    return chat_request_to_conversation(dict(body))[1]


def responses(tool_choice=None, tools=None, **kw):
    body: ResponseCreateParamsNonStreaming = {
        "model": "m", "input": "weather in Paris?",
        "tools": tools if tools is not None else [
            FunctionToolParam(type="function", name=n, parameters=CITY, strict=True)
            for n in ("get_weather", "get_time")],
        **kw}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    req = parse_responses_request(dict(body))
    return req, responses_to_conversation(req)[0]


def resp_allowed(mode, *entries) -> ToolChoiceAllowedParam:
    return {"type": "allowed_tools", "mode": mode, "tools": list(entries)}


def call_names(tag) -> set[str]:
    """The tool names a hermes structural tag lets the model call."""
    text = json.dumps(tag)
    return {n for n in ("get_weather", "get_time", "get_news", "apply_patch") if f'\\"name\\": \\"{n}\\"' in text}


# -- Chat Completions ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["auto", "required"])
def test_chat_allowed_tools_keeps_every_tool_and_allows_the_listed_ones(mode):
    conv = chat(chat_allowed(mode, "get_weather", "get_news"), parallel_tool_calls=False)
    assert [t.name for t in conv.tools] == ["get_weather", "get_time", "get_news"]
    assert conv.tool_choice == ToolChoice(mode, parallel=False, allowed=("get_weather", "get_news"))
    assert check_choice(conv.tool_choice, conv.tools) is None
    assert call_names(structural_tag("hermes", conv.tools, conv.tool_choice)) == {"get_weather", "get_news"}


def test_the_prompt_does_not_change_with_the_allowance(tok):  # noqa: F811
    r = renderer(tok, "qwen3_like.jinja")
    plain = r.render_sync(chat("auto"), GenerationOptions())
    for choice in (chat_allowed("required", "get_time"), chat_allowed("auto", "get_weather")):
        assert r.render_sync(chat(choice), GenerationOptions()).token_ids == plain.token_ids
    assert all(n in plain.text for n in ("get_weather", "get_time", "get_news"))


@pytest.mark.parametrize("choice, param", [
    (chat_allowed("auto", "get_weather", "nope"), "tool_choice.allowed_tools.tools.1.function.name"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [{"type": "function"}]}},
     "tool_choice.allowed_tools.tools.0.function.name"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "required",
                                                 "tools": [{"type": "custom", "custom": {"name": "get_weather"}}]}},
     "tool_choice.allowed_tools.tools.0.type"),
    ({"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}}, "tool_choice.allowed_tools.mode"),
    ({"type": "allowed_tools"}, "tool_choice.allowed_tools"),
])
def test_chat_allowed_tools_errors_name_the_entry(choice, param):
    with pytest.raises(InvalidRequest) as e:
        chat(choice)
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)
    if param.endswith("function.name") and "nope" in json.dumps(choice):
        assert "'nope'" in e.value.message


def test_chat_required_with_an_empty_allowance_is_the_tool_choice_400():
    conv = chat(chat_allowed("required"))
    assert "allows none" in check_choice(conv.tool_choice, conv.tools)
    conv = chat(chat_allowed("auto"))  # auto allowing nothing: no call can be written, as with `none`
    assert check_choice(conv.tool_choice, conv.tools) is None
    assert structural_tag("hermes", conv.tools, conv.tool_choice) == structural_tag(
        "hermes", conv.tools, ToolChoice("none"))


def test_chat_custom_tools_and_choice_are_a_400_that_points_to_responses():
    custom_choice: ChatCompletionNamedToolChoiceCustomParam = {"type": "custom", "custom": {"name": "get_weather"}}
    with pytest.raises(InvalidRequest) as e:
        chat(custom_choice)
    assert e.value.param == "tool_choice.type" and "custom tools are not supported" in e.value.message
    assert "Responses" in e.value.message
    custom_tool: ChatCompletionCustomToolParam = {"type": "custom", "custom": {"name": "apply_patch"}}
    with pytest.raises(InvalidRequest) as e:
        chat_request_to_conversation({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                      "tools": [chat_tool("get_weather"), custom_tool]})
    assert e.value.param == "tools.1.type" and "custom tools are not supported" in e.value.message


def test_chat_unknown_choice_and_tool_types_name_the_supported_values():
    with pytest.raises(InvalidRequest) as e:
        chat({"type": "hosted"})
    assert e.value.param == "tool_choice.type" and "'function', 'allowed_tools'" in e.value.message
    with pytest.raises(InvalidRequest) as e:
        chat_request_to_conversation({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                      "tools": [{"type": "function"}]})
    assert e.value.param == "tools.0.function"


# -- Responses ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["auto", "required"])
def test_responses_allowed_tools_keeps_every_tool_and_allows_the_listed_ones(mode):
    choice = resp_allowed(mode, {"type": "function", "name": "get_time"})
    req, conv = responses(choice, parallel_tool_calls=False)
    assert [t.name for t in conv.tools] == ["get_weather", "get_time"]
    assert conv.tool_choice == ToolChoice(mode, parallel=False, allowed=("get_time",))
    assert call_names(structural_tag("hermes", conv.tools, conv.tool_choice)) == {"get_time"}
    assert echo_fields(req)["tool_choice"] == choice  # the response repeats the choice as sent


def test_responses_allowed_tools_covers_custom_tools_and_passes_over_hosted_ones():
    tools = [FunctionToolParam(type="function", name="get_weather", parameters=CITY, strict=True),
             CustomToolParam(type="custom", name="apply_patch"), WebSearchToolParam(type="web_search")]
    _, conv = responses(resp_allowed("required", {"type": "custom", "name": "apply_patch"}, {"type": "web_search"}),
                        tools)
    assert conv.tool_choice.allowed == ("apply_patch",) and check_choice(conv.tool_choice, conv.tools) is None
    assert call_names(structural_tag("hermes", conv.tools, conv.tool_choice)) == {"apply_patch"}
    # a hosted tool is never offered to the model: allowing only it allows no call
    _, conv = responses(resp_allowed("required", {"type": "web_search"}), tools)
    assert "allows none" in check_choice(conv.tool_choice, conv.tools)


@pytest.mark.parametrize("choice, param", [
    (resp_allowed("auto", {"type": "function", "name": "nope"}), "tool_choice.tools[0].name"),
    (resp_allowed("auto", {"type": "function", "name": "get_weather"}, {"type": "custom", "name": "get_time"}),
     "tool_choice.tools[1].name"),  # get_time is a function tool, not a custom one
    (resp_allowed("required", {"type": "function"}), "tool_choice.tools[0].name"),
    (resp_allowed("required", {"type": "image_generation"}), "tool_choice.tools[0].type"),  # not in tools
    ({"type": "allowed_tools", "mode": "always", "tools": []}, "tool_choice.mode"),
    ({"type": "allowed_tools", "mode": "auto"}, "tool_choice.tools"),
])
def test_responses_allowed_tools_errors_name_the_entry(choice, param):
    with pytest.raises(InvalidRequest) as e:
        responses(choice)
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)
