"""Responses request → Conversation: item mapping, assistant-turn merging, tools, options; the reasoning sealer;
the response store's logic (TTL, caps)."""

from __future__ import annotations

import base64
import json

import pytest

from serve_app.conversation import ImagePart, ReasoningPart, TextPart, ToolCallPart, ToolResultPart
from serve_app.errors import InvalidRequest
from serve_app.ingress.common import parse_model
from serve_app.ingress.responses.convert import (
    custom_tool_names,
    echo_fields,
    parse_responses_request,
    responses_to_conversation,
)
from serve_app.ingress.responses.reasoning_crypto import ReasoningSealer
from serve_app.protocols.responses import ResponsesRequest

SEALER = ReasoningSealer(b"k1")


def convert(body, sealer=SEALER, history=None):
    req = parse_responses_request(body)
    conv, opts = responses_to_conversation(req, lambda t, p: sealer.open(t, param=p), history)
    return req, conv, opts


CODEX_BODY = {
    "model": "m",
    "instructions": "You are Codex.",
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "fix it"},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}], "encrypted_content": None,
         "content": [{"type": "reasoning_text", "text": "thought 0"}]},
        {"type": "function_call", "name": "exec_command", "arguments": "{\"cmd\": \"ls\"}", "call_id": "c0"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "thought 1"}]},
        {"type": "custom_tool_call", "name": "apply_patch", "input": "*** Begin Patch\n*** End Patch", "call_id": "c1"},
        {"type": "function_call_output", "call_id": "c0", "output": "a.txt"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}],
         "phase": "final_answer"},
        {"type": "message", "role": "user", "content": "thanks"},
    ],
    "tools": [
        {"type": "function", "name": "exec_command", "description": "run", "strict": False,
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
        {"type": "custom", "name": "apply_patch", "description": "patch files",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: patch"}},
        {"type": "local_shell"},
        {"type": "web_search", "external_web_access": False},
    ],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "reasoning": {"effort": "medium", "summary": "auto"},
    "store": False,
    "stream": True,
    "include": ["reasoning.encrypted_content"],
    "prompt_cache_key": "conv-123",
    "text": {"verbosity": "low"},
    "client_metadata": {"x": 1},  # unknown fields are accepted
    "service_tier": "auto",
}


def test_codex_request_maps_in_order():
    req, conv, opts = convert(CODEX_BODY)
    roles = [m.role for m in conv.messages]
    assert roles == ["system", "developer", "user", "assistant", "tool", "tool", "assistant", "user"]
    assert conv.messages[0].parts == [TextPart("You are Codex.")]
    user = conv.messages[2].parts
    assert user[0] == TextPart("fix it") and isinstance(user[1], ImagePart) and user[1].media_type == "image/png"
    # reasoning, call, reasoning, custom call: one assistant turn, in the order given
    turn = conv.messages[3].parts
    assert [type(p) for p in turn] == [ReasoningPart, ToolCallPart, ReasoningPart, ToolCallPart]
    assert turn[0].text == "thought 0" and turn[2].text == "thought 1"
    assert turn[1] == ToolCallPart(id="c0", name="exec_command", arguments='{"cmd": "ls"}')
    assert turn[3].kind == "custom" and json.loads(turn[3].arguments) == {"input": "*** Begin Patch\n*** End Patch"}
    out0, out1 = conv.messages[4].parts[0], conv.messages[5].parts[0]
    assert isinstance(out0, ToolResultPart) and out0.content == "a.txt" and out0.name == "exec_command"
    assert out1.content == "ok" and out1.name == "apply_patch"
    assert conv.messages[6].parts == [TextPart("Done.")]
    # tools: function as is, custom as a function with one string parameter; hosted tools dropped
    assert [(t.name, t.kind) for t in conv.tools] == [("exec_command", "function"), ("apply_patch", "custom")]
    assert conv.tools[1].parameters["required"] == ["input"] and "start: patch" in conv.tools[1].description
    assert custom_tool_names(req) == {"apply_patch"}
    assert opts.thinking is True and opts.reasoning_effort == "medium" and opts.session_key == "conv-123"
    assert req.wants_encrypted_reasoning()


def test_string_input_and_options():
    req, conv, opts = convert({"model": "m", "input": "hi", "max_output_tokens": 50, "temperature": 0.2,
                               "reasoning": {"effort": "none"},
                               "nvext": {"forced_script": "ok", "agent_hints": {"priority": 3, "osl": 40}}})
    assert [(m.role, m.parts) for m in conv.messages] == [("user", [TextPart("hi")])]
    assert opts.max_tokens == 50 and opts.temperature == 0.2 and opts.thinking is False
    assert opts.forced_script == "ok" and opts.hints.priority == 3 and opts.hints.osl == 40


@pytest.mark.parametrize("fields, thinking", [
    ({}, None),
    ({"reasoning": {"effort": "low"}}, True),
    ({"reasoning": {"effort": "high"}, "chat_template_kwargs": {"enable_thinking": False}}, False),  # vLLM's order
    ({"chat_template_kwargs": {"enable_thinking": True}}, True),
    ({"reasoning": {"effort": "high"}, "chat_template_kwargs": {"thinking": False}}, False),
])
def test_chat_template_kwargs_reach_the_template_and_switch_thinking(fields, thinking):
    _, _, opts = convert({"model": "m", "input": "hi", **fields})
    assert opts.thinking is thinking
    assert opts.chat_template_kwargs == fields.get("chat_template_kwargs", {})


def test_adjacent_assistant_items_after_assistant_message_merge():
    _, conv, _ = convert({"model": "m", "input": [
        {"type": "message", "role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "a"},
        {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "b"},
        {"type": "function_call_output", "call_id": "a", "output": "1"},
        {"type": "function_call_output", "call_id": "b", "output": "2"},
    ]})
    assert [m.role for m in conv.messages] == ["user", "assistant", "tool", "tool"]
    assert [type(p).__name__ for p in conv.messages[1].parts] == ["TextPart", "ToolCallPart", "ToolCallPart"]


def test_encrypted_reasoning_is_opened_and_forgery_rejected():
    token = SEALER.seal("exact  thought\n")
    body = {"model": "m", "input": [{"type": "reasoning", "summary": [], "encrypted_content": token,
                                     "content": [{"type": "reasoning_text", "text": "client-edited"}]}]}
    _, conv, _ = convert(body)
    assert conv.messages[0].parts[0].text == "exact  thought\n"  # the sealed text wins over the echoed content
    raw = bytearray(base64.urlsafe_b64decode(token))
    raw[-1] ^= 1
    body["input"][0]["encrypted_content"] = base64.urlsafe_b64encode(bytes(raw)).decode()
    with pytest.raises(InvalidRequest) as e:
        convert(body)
    assert e.value.status == 400 and e.value.param == "input.0.encrypted_content"
    body["input"][0]["encrypted_content"] = token
    with pytest.raises(InvalidRequest):
        convert(body, sealer=ReasoningSealer(b"another server"))
    body["input"][0]["encrypted_content"] = "gAAAAABgarbage"
    with pytest.raises(InvalidRequest):
        convert(body)


def test_sealer_round_trip_and_nonce():
    text = "a private chain of thought"
    a, b = SEALER.seal(text), SEALER.seal(text)
    assert a != b and SEALER.open(a) == SEALER.open(b) == text  # fresh nonce per seal
    assert text.encode() not in base64.urlsafe_b64decode(a)


@pytest.mark.parametrize("body,param", [
    ({"input": "x"}, "model"),
    ({"model": "m", "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
    ({"model": "m", "input": [{"type": "message", "role": "robot", "content": "x"}]}, "input.0.role"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
])
def test_validation_errors_name_the_field(body, param):
    with pytest.raises(InvalidRequest) as e:
        convert(body)
    assert e.value.param == param and param in e.value.message


def test_named_tool_choice_must_exist():
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    _, conv, _ = convert({"model": "m", "input": "x", "tools": tools, "tool_choice": {"type": "function", "name": "f"},
                          "parallel_tool_calls": False})
    assert conv.tool_choice.mode == "tool" and conv.tool_choice.name == "f" and conv.tool_choice.parallel is False
    with pytest.raises(InvalidRequest):
        convert({"model": "m", "input": "x", "tools": tools, "tool_choice": {"type": "function", "name": "g"}})


def test_history_prepends_previous_items():
    history = parse_model(ResponsesRequest, {"model": "m", "input": [
        {"type": "message", "role": "user", "content": "first"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "answer", "annotations": [], "logprobs": []}]},
    ]}).input
    _, conv, _ = convert({"model": "m", "instructions": "sys", "input": "second"}, history=history)
    assert [(m.role, m.parts[0].text) for m in conv.messages] == [
        ("system", "sys"), ("user", "first"), ("assistant", "answer"), ("user", "second")]


def test_echo_fields():
    req = parse_model(ResponsesRequest, CODEX_BODY)
    echo = echo_fields(req)
    assert echo["instructions"] == "You are Codex." and echo["store"] is False
    assert echo["reasoning"] == {"effort": "medium", "summary": "auto"}
    assert echo["prompt_cache_key"] == "conv-123" and echo["text"]["verbosity"] == "low"
    assert [t["type"] for t in echo["tools"]] == ["function", "custom", "local_shell", "web_search"]
    assert echo["safety_identifier"] is None
    with_user = parse_model(ResponsesRequest, {**CODEX_BODY, "user": "u-1", "safety_identifier": "sid-1"})
    assert echo_fields(with_user)["safety_identifier"] == "sid-1"
    # safety_identifier is `user`'s successor: it is who the session is for, where both are sent.
    assert responses_to_conversation(with_user, SEALER.open)[1].user_key == "sid-1"


def test_output_items_sent_back_rebuild_the_generated_turn():
    """Turn N's output, sent back as turn N+1's input, is the same assistant turn the events folded to: same order,
    same reasoning text (exact, via the sealed copy), byte-identical function arguments, freeform input intact."""
    from serve_app.conversation import Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd, \
        ToolCallStart, Usage, fold_events
    from serve_app.ingress.responses.encode import ResponsesEncoder, fold

    patch = "*** Begin Patch\n*** Add File: x\n+é \"q\"\n*** End Patch\n"
    events = [ReasoningDelta("think "), ReasoningDelta("0"), TextDelta("Let me look."),
              ToolCallStart(0, "call_a", "exec_command"), ToolCallArgsDelta(0, '{"cmd":'), ToolCallArgsDelta(0, ' "ls"}'),
              ToolCallEnd(0), ReasoningDelta("think 1"),
              ToolCallStart(1, "call_b", "apply_patch"), ToolCallArgsDelta(1, json.dumps({"input": patch})),
              ToolCallEnd(1), Usage(5, 5), Finish("tool_calls")]
    enc = ResponsesEncoder(response_id="r", model="m", echo={}, custom_tools={"apply_patch"}, seal=SEALER.seal)
    output = fold(enc, events)["output"]
    for item in output:  # what a client that keeps only the sealed copy sends back
        if item["type"] == "reasoning":
            item["content"] = []
    _, conv, _ = convert({"model": "m", "input": [{"role": "user", "content": "go"}, *output]})
    expected = fold_events(events)
    expected[-1].kind = "custom"
    got = conv.messages[-1].parts
    assert [type(p) for p in got] == [type(p) for p in expected]
    for g, e in zip(got, expected):
        if isinstance(e, ToolCallPart):
            assert (g.id, g.name, g.kind) == (e.id, e.name, e.kind)
            assert g.arguments == e.arguments if e.kind == "function" else json.loads(g.arguments) == {"input": patch}
        else:
            assert g.text == e.text
