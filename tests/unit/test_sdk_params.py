"""Every parameter the installed `anthropic` and `openai` SDKs can send is accepted by the request parsers, and the
few that ask for something this server cannot do are refused with a 400 naming them.

The tables below give each SDK parameter a value a client would send. A parameter the SDK adds in a later release
fails `test_the_tables_cover_every_sdk_parameter` until someone decides what it does here and writes that into
docs/anthropic.md (checked by `test_the_docs_name_every_sdk_parameter`)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from anthropic.resources.beta.messages.messages import Messages as BetaMessages
from anthropic.resources.messages.messages import Messages
from openai.resources.chat.completions import Completions
from openai.resources.responses import Responses

from serve_app.errors import ServiceError
from serve_app.ingress.anthropic.convert import count_tokens_request, messages_request, to_conversation
from serve_app.ingress.chat.convert import chat_request_to_conversation
from serve_app.ingress.responses.convert import parse_responses_request, responses_to_conversation

DOCS = Path(__file__).resolve().parents[2] / "docs" / "anthropic.md"
NOT_BODY = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
SECRET = b"s" * 32


def sdk_params(method) -> set[str]:
    return set(inspect.signature(method).parameters) - NOT_BODY


TOOL = {"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object", "properties": {}},
        "cache_control": {"type": "ephemeral"}, "strict": True, "defer_loading": False, "eager_input_streaming": True,
        "input_examples": [{}], "allowed_callers": ["direct"]}

# Anthropic: messages.create / count_tokens, plain and beta. `None` marks a parameter that is refused when set.
ANTHROPIC = {
    "max_tokens": 4096,
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "citations": None}]}],
    "model": "m",
    "cache_control": {"type": "ephemeral", "ttl": "1h"},
    "container": "container_1",
    "diagnostics": {"previous_message_id": None},
    "inference_geo": "us",
    "metadata": {"user_id": "u1"},
    "output_config": {"effort": "max", "format": {"type": "json_schema", "schema": {"type": "object"}}},
    "output_format": {"type": "json_schema", "schema": {"type": "object"}},
    "service_tier": "standard_only",
    "speed": "fast",
    "stop_sequences": ["END"],
    "stream": True,
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    "tools": [TOOL],
    "user_profile_id": "up_1",
    "workspace_id": "wrkspc_1",
    # beta
    "betas": ["context-management-2025-06-27"],
    "billing_policy": {"type": "billing_policy", "bill_to": "self"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "fallback_credit_token": "fct_1",
    "fallbacks": "default",
    "mcp_servers": [],
    "thread": None,
    "compaction": None,
}
ANTHROPIC_REFUSED = {  # param -> a value asking for what this server cannot do
    "compaction": {"type": "summarize"},
    "mcp_servers": [{"type": "url", "name": "docs", "url": "https://mcp.example.com"}],
    "thread": {"type": "create"},
}

CHAT = {
    "messages": [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "text", "text": "hi", "prompt_cache_breakpoint": True}]}],
    "model": "m",
    "audio": None,
    "frequency_penalty": 0.5,
    "function_call": None,
    "functions": None,
    "logit_bias": {"50256": -100},
    "logprobs": False,
    "max_completion_tokens": 100,
    "max_tokens": 100,
    "metadata": {"k": "v"},
    "modalities": ["text"],
    "moderation": {"mode": "off"},
    "n": 1,
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "hello"},
    "presence_penalty": -0.5,
    "prompt_cache_key": "sess-1",
    "prompt_cache_options": {"ttl": "1h"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "max",
    "response_format": {"type": "json_object"},
    "safety_identifier": "user-hash",
    "seed": 7,
    "service_tier": "auto",
    "stop": ["END"],
    "store": False,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.2,
    "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "top_logprobs": 0,
    "top_p": 0.9,
    "user": "u1",
    "verbosity": "low",
    "web_search_options": None,
}
CHAT_REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "logprobs": True,
    "web_search_options": {},
    "n": 2,
}

RESPONSES = {
    "access_programs": ["research"],
    "background": False,
    "background_options": {"completion_window": "2h"},
    "context_management": [{"type": "compaction", "compact_threshold": 100000}],
    "conversation": None,
    "image": {"detail": "auto"},
    "include": ["reasoning.encrypted_content"],
    "input": [{"role": "user", "content": "hi"}],
    "instructions": "Be brief.",
    "max_output_tokens": 100,
    "max_tool_calls": 3,
    "metadata": {"k": "v"},
    "model": "m",
    "moderation": {"mode": "off"},
    "parallel_tool_calls": False,
    "previous_response_id": None,
    "prompt": None,
    "prompt_cache_key": "sess-1",
    "prompt_cache_options": {"ttl": "1h"},
    "prompt_cache_retention": "24h",
    "reasoning": {"effort": "max", "summary": "detailed", "generate_summary": "auto"},
    "safety_identifier": "user-hash",
    "service_tier": "flex",
    "store": False,
    "stream": True,
    "stream_options": {"include_obfuscation": False},
    "temperature": 0.2,
    "text": {"format": {"type": "text"}, "verbosity": "high"},
    "tool_choice": "auto",
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}],
    "top_logprobs": 0,
    "top_p": 0.9,
    "truncation": "auto",
    "user": "u1",
}
RESPONSES_REFUSED = {
    "conversation": "conv_1",
    "prompt": {"id": "pmpt_1", "version": "2"},
}


def test_the_tables_cover_every_sdk_parameter():
    for method in (Messages.create, Messages.count_tokens, BetaMessages.create, BetaMessages.count_tokens):
        assert sdk_params(method) <= set(ANTHROPIC), sdk_params(method) - set(ANTHROPIC)
    assert sdk_params(Completions.create) <= set(CHAT), sdk_params(Completions.create) - set(CHAT)
    assert sdk_params(Responses.create) <= set(RESPONSES), sdk_params(Responses.create) - set(RESPONSES)


def test_the_docs_name_every_sdk_parameter():
    text = DOCS.read_text()
    names = set(ANTHROPIC) | set(CHAT) | set(RESPONSES)
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"docs/anthropic.md does not say what these do here: {missing}"


def test_every_anthropic_parameter_is_accepted():
    conv, opts = to_conversation(messages_request(dict(ANTHROPIC)), SECRET)
    assert opts.thinking is True and opts.reasoning_effort == "max" and opts.output_format is not None
    assert [t.name for t in conv.tools] == ["get_weather"] and conv.tool_choice.parallel is False
    counted = {k: v for k, v in ANTHROPIC.items() if k not in ("max_tokens", "stream", "stop_sequences")}
    to_conversation(count_tokens_request(counted), SECRET)
    # count_tokens accepts a compaction config and counts the conversation as sent, as the API does.
    to_conversation(count_tokens_request({**counted, "compaction": ANTHROPIC_REFUSED["compaction"]}), SECRET)


@pytest.mark.parametrize("name", sorted(ANTHROPIC_REFUSED))
def test_anthropic_parameters_asking_for_missing_machinery_are_a_400_naming_them(name):
    with pytest.raises(ServiceError) as e:
        to_conversation(messages_request({**ANTHROPIC, name: ANTHROPIC_REFUSED[name]}), SECRET)
    assert e.value.status == 400 and e.value.param == name and e.value.message.startswith(f"{name}: ")


def test_every_chat_parameter_is_accepted():
    _, conv, opts = chat_request_to_conversation(dict(CHAT))
    assert (opts.frequency_penalty, opts.presence_penalty, opts.logit_bias) == (0.5, -0.5, {50256: -100.0})
    assert opts.seed == 7 and opts.stop == ["END"] and conv.tool_choice.parallel is False


@pytest.mark.parametrize("name", sorted(CHAT_REFUSED))
def test_chat_parameters_asking_for_missing_output_are_a_400_naming_them(name):
    with pytest.raises(ServiceError) as e:
        chat_request_to_conversation({**CHAT, name: CHAT_REFUSED[name]})
    assert e.value.status == 400 and e.value.param == name


@pytest.mark.parametrize("field,value", [("frequency_penalty", 2.5), ("presence_penalty", -3),
                                         ("logit_bias", {"1": 101})])
def test_chat_sampling_ranges_are_openais(field, value):
    with pytest.raises(ServiceError) as e:
        chat_request_to_conversation({**CHAT, field: value})
    assert e.value.status == 400 and e.value.param == field


def test_every_responses_parameter_is_accepted():
    req = parse_responses_request(dict(RESPONSES))
    conv, opts = responses_to_conversation(req)
    assert opts.thinking is True and opts.reasoning_effort == "max" and conv.tool_choice.parallel is False


@pytest.mark.parametrize("name", sorted(RESPONSES_REFUSED))
def test_responses_parameters_naming_missing_server_objects_are_a_400(name):
    with pytest.raises(ServiceError) as e:
        parse_responses_request({**RESPONSES, name: RESPONSES_REFUSED[name]})
    assert e.value.status == 400 and e.value.param == name
