"""`tool_choice` through the real engine, unforced: the grammar (serve_app/parsers/tool_grammar.py) makes even the
135M default model answer a forced choice with a schema-valid call in its own format, on every API, streamed and
not, through the real SDKs. No script rule matches these prompts: the words are the model's."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.integration

PLAIN = "smollm2-135m-instruct"  # hermes calls
XML = "test-qwen3-coder"  # qwen3_coder XML calls after an optional think block
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
ASK = "What will the weather be in Paris for the next three days?"


@pytest.fixture(scope="module")
def claude(serve_url):
    return anthropic.Anthropic(base_url=serve_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(serve_url):
    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _anthropic_tools():
    return [{"name": "get_weather", "description": "Weather forecast", "input_schema": SCHEMA},
            {"name": "get_time", "description": "Current time", "input_schema": CLOCK}]


def _chat_tools():
    return [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                              "parameters": SCHEMA}},
            {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                              "parameters": CLOCK}}]


def _responses_tools():
    return [{"type": "function", "name": t["function"]["name"], "description": t["function"]["description"],
             "parameters": t["function"]["parameters"], "strict": True} for t in _chat_tools()]


def _valid(name: str, args: dict) -> None:
    jsonschema.validate(args, SCHEMA if name == "get_weather" else CLOCK)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_named_tool_is_one_valid_call(claude, stream):
    kw = dict(model=PLAIN, max_tokens=120, messages=[{"role": "user", "content": ASK}], tools=_anthropic_tools(),
              tool_choice={"type": "tool", "name": "get_time"}, extra_body={"temperature": 0})
    if stream:
        with claude.messages.stream(**kw) as s:
            msg = s.get_final_message()
    else:
        msg = claude.messages.create(**kw)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert [u.name for u in uses] == ["get_time"], msg.content  # the named tool, though the question is weather
    _valid(uses[0].name, uses[0].input)
    assert msg.stop_reason == "tool_use" and not [b for b in msg.content if b.type == "text" and b.text.strip()]


def test_anthropic_any_without_parallel_calls_is_exactly_one_call(claude):
    msg = claude.messages.create(
        model=PLAIN, max_tokens=200, messages=[{"role": "user", "content": ASK}], tools=_anthropic_tools(),
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0})
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and msg.stop_reason == "tool_use"
    _valid(uses[0].name, uses[0].input)


def test_anthropic_none_never_calls(claude):
    # with `none` the model cannot write the call marker at all (the tools stay in the prompt)
    msg = claude.messages.create(
        model=PLAIN, max_tokens=40, tools=_anthropic_tools(), tool_choice={"type": "none"},
        messages=[{"role": "user", "content": ASK}], extra_body={"temperature": 0})
    assert not [b for b in msg.content if b.type == "tool_use"] and msg.stop_reason != "tool_use"
    assert "<tool_call>" not in "".join(b.text for b in msg.content if b.type == "text")


def test_a_forced_tool_with_thinking_on_is_the_apis_400(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=PLAIN, max_tokens=2048, messages=[{"role": "user", "content": ASK}],
                               tools=_anthropic_tools(), tool_choice={"type": "any"},
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "tool_choice forces tool use" in e.value.body["error"]["message"]


def _chat_calls(oai, stream: bool, **kw) -> tuple[list[tuple[str, dict]], str | None]:
    """(name, arguments) of each call in the answer, and its finish reason, streamed (deltas folded) or not."""
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in oai.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for tc in choice.delta.tool_calls or []:
                    c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
        return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())], finish
    resp = oai.chat.completions.create(**kw)
    calls = resp.choices[0].message.tool_calls or []
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls], resp.choices[0].finish_reason


@pytest.mark.parametrize("model", [PLAIN, XML])
@pytest.mark.parametrize("stream", [False, True])
def test_chat_named_function_is_one_valid_call(oai, model, stream):
    got, finish = _chat_calls(oai, stream, model=model, max_tokens=200, temperature=0,
                              messages=[{"role": "user", "content": ASK}], tools=_chat_tools(),
                              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [n for n, _ in got] == ["get_weather"] and finish == "tool_calls"
    _valid(*got[0])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_allowed_tools_required_calls_only_the_allowed_tool(oai, stream):
    # both tools are in the prompt and the question is about the weather; only get_time is allowed
    allowed = {"type": "allowed_tools",
               "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}
    got, finish = _chat_calls(oai, stream, model=PLAIN, max_tokens=200, temperature=0,
                              messages=[{"role": "user", "content": ASK}], tools=_chat_tools(), tool_choice=allowed)
    assert got and {n for n, _ in got} == {"get_time"} and finish == "tool_calls"
    for name, args in got:
        _valid(name, args)


def test_chat_allowed_tools_naming_no_given_tool_is_a_400(oai):
    allowed = {"type": "allowed_tools",
               "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=PLAIN, max_tokens=5, messages=[{"role": "user", "content": ASK}],
                                    tools=_chat_tools(), tool_choice=allowed)
    assert e.value.body["type"] == "invalid_request_error" and "'nope'" in e.value.body["message"]
    assert e.value.body["param"] == "tool_choice.allowed_tools.tools.0.function.name"


def test_chat_required_without_parallel_calls_is_one_call(oai):
    resp = oai.chat.completions.create(
        model=PLAIN, max_tokens=200, temperature=0, messages=[{"role": "user", "content": ASK}], tools=_chat_tools(),
        tool_choice="required", parallel_tool_calls=False)
    calls = resp.choices[0].message.tool_calls or []
    assert len(calls) == 1 and resp.choices[0].finish_reason == "tool_calls"
    _valid(calls[0].function.name, json.loads(calls[0].function.arguments))


def test_chat_tool_choice_naming_no_given_tool_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=PLAIN, max_tokens=5, messages=[{"role": "user", "content": ASK}],
                                    tools=_chat_tools(), tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["type"] == "invalid_request_error" and "'nope'" in e.value.body["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_required_is_a_valid_function_call(oai, stream):
    tools = _responses_tools()
    kw = dict(model=PLAIN, max_output_tokens=200, temperature=0, input=ASK, tools=tools, tool_choice="required")
    if stream:
        with oai.responses.stream(**kw) as s:
            resp = s.get_final_response()
    else:
        resp = oai.responses.create(**kw)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and resp.status == "completed"
    for c in calls:
        _valid(c.name, json.loads(c.arguments))


def test_chat_none_never_calls(oai):
    resp = oai.chat.completions.create(model=PLAIN, max_tokens=40, temperature=0, tools=_chat_tools(),
                                       tool_choice="none", messages=[{"role": "user", "content": ASK}])
    msg = resp.choices[0].message
    assert not msg.tool_calls and resp.choices[0].finish_reason != "tool_calls"
    assert "<tool_call>" not in (msg.content or "")


def test_responses_named_function_is_one_valid_call(oai):
    tools = _responses_tools()
    resp = oai.responses.create(model=PLAIN, max_output_tokens=200, temperature=0, input=ASK, tools=tools,
                                tool_choice={"type": "function", "name": "get_time"})
    calls = [item for item in resp.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_time"] and resp.status == "completed"
    _valid(calls[0].name, json.loads(calls[0].arguments))
