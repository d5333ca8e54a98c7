"""Chat Completions: request validation names the field; events encode to chunks whose fold equals the
non-streaming body."""

from __future__ import annotations

import json

import pytest

from serve_app.conversation import (
    Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, ToolCallPart, ToolResultPart,
    ReasoningPart, Usage,
)
from serve_app.errors import InvalidRequest
from serve_app.ingress.chat.convert import chat_request_to_conversation
from serve_app.ingress.chat.encode import ChatStreamEncoder, completion_body


def body(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        (body(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role"),
        (body(max_tokens="many"), "max_tokens"),
        (body(max_tokens=0), "max_tokens"),
        (body(temperature=5), "temperature"),
        (body(n=3), "n"),
        (body(messages=[{"role": "tool", "content": "x"}]), "messages.0.tool_call_id"),
        (body(tool_choice={"type": "function", "function": {}}), "tool_choice.function.name"),
        (body(messages=[{"role": "user", "content": [{"type": "audio"}]}]), "messages.0.content.0.type"),
    ],
)
def test_invalid_requests_name_the_field(payload, param):
    with pytest.raises(InvalidRequest) as e:
        chat_request_to_conversation(payload)
    assert e.value.param == param
    assert param in e.value.message


def test_history_maps_to_the_ir():
    req, conv, opts = chat_request_to_conversation(body(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "list files"}]},
            {"role": "assistant", "content": None, "reasoning_content": "use ls",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{\"p\": \".\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        ],
        tools=[{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}],
        tool_choice="required", stop="END", max_completion_tokens=7, prompt_cache_key="sess", user="u-1",
        nvext={"agent_hints": {"osl": 30, "priority": 2}, "forced_script": "ok"},
        chat_template_kwargs={"enable_thinking": False},
    ))
    roles = [m.role for m in conv.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assistant = conv.messages[2].parts
    assert isinstance(assistant[0], ReasoningPart) and assistant[0].text == "use ls"
    assert isinstance(assistant[1], ToolCallPart) and assistant[1].arguments == "{\"p\": \".\"}"
    assert isinstance(conv.messages[3].parts[0], ToolResultPart)
    assert conv.tools[0].name == "ls" and conv.tool_choice.mode == "required"
    assert opts.stop == ["END"] and opts.max_tokens == 7 and opts.session_key == "sess" and opts.user_key == "u-1"
    assert opts.hints.osl == 30 and opts.hints.priority == 2 and opts.forced_script == "ok"
    assert opts.thinking is False


@pytest.mark.parametrize("fields, thinking", [
    ({}, None),
    ({"enable_thinking": False}, False),  # DashScope's top-level switch (OpenClaw's qwenThinkingFormat top-level)
    ({"enable_thinking": True, "reasoning_effort": "none"}, True),
    ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, False),  # the kwargs win
    ({"reasoning_effort": "minimal"}, False),
    ({"chat_template_kwargs": {"thinking": False}, "reasoning_effort": "high"}, False),  # DeepSeek/Kimi's switch
    ({"chat_template_kwargs": {"thinking": True, "enable_thinking": False}}, False),  # enable_thinking first
    ({"chat_template_kwargs": {"thinking": {"type": "enabled"}}}, None),  # not a switch: left to the template
])
def test_the_thinking_switch_and_its_precedence(fields, thinking):
    assert chat_request_to_conversation(body(**fields))[2].thinking is thinking


def test_a_top_level_enable_thinking_that_is_not_a_boolean_is_a_400():
    with pytest.raises(InvalidRequest) as e:
        chat_request_to_conversation(body(enable_thinking={"on": 1}))
    assert e.value.param == "enable_thinking"


def parse_sse(frames: list[bytes]):
    events = []
    for f in b"".join(frames).decode().split("\n\n"):
        if not f.strip():
            continue
        name, data = None, None
        for line in f.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
        events.append((name, data if data == "[DONE]" else json.loads(data)))
    return events


EVENTS = [
    Usage(10, 0, cached_tokens=0, estimated=True),
    ReasoningDelta("think "), ReasoningDelta("more"),
    TextDelta("Hello"), TextDelta(" world"),
    ToolCallStart(0, "call_a", "ls"), ToolCallArgsDelta(0, "{\"p\""), ToolCallArgsDelta(0, ": 1}"), ToolCallEnd(0),
    ToolCallStart(1, "call_b", "cat"), ToolCallArgsDelta(1, "{}"), ToolCallEnd(1),
    Usage(10, 9, cached_tokens=4, reasoning_tokens=2),
    Finish("tool_calls"),
]


def fold_chunks(events):
    content, reasoning, calls, finish, usage = "", "", {}, None, None
    for name, data in events:
        if name is not None or data == "[DONE]":
            continue
        if data.get("usage"):
            usage = data["usage"]
        for choice in data["choices"]:
            d = choice["delta"]
            content += d.get("content") or ""
            reasoning += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                c = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                c["id"] = tc.get("id") or c["id"]
                c["name"] = (tc.get("function") or {}).get("name") or c["name"]
                c["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, reasoning, calls, finish, usage


def test_stream_folds_to_the_non_streaming_body():
    enc = ChatStreamEncoder("m", "r1", include_usage=True)
    frames = [enc.start()] + [f for ev in EVENTS for f in enc.event(ev)]
    events = parse_sse(frames)
    assert events[-1] == (None, "[DONE]")
    content, reasoning, calls, finish, usage = fold_chunks(events)
    full = completion_body("m", "r1", EVENTS)
    msg = full["choices"][0]["message"]
    assert content == msg["content"] == "Hello world"
    assert reasoning == msg["reasoning_content"] == "think more"
    assert [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (t["id"], t["function"]["name"], t["function"]["arguments"]) for t in msg["tool_calls"]]
    assert finish == full["choices"][0]["finish_reason"] == "tool_calls"
    assert usage == full["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 4 and usage["total_tokens"] == 19


def test_tool_dispatch_arrives_once_per_call_before_the_final_chunk():
    enc = ChatStreamEncoder("m", "r1", dispatch=True)
    events = parse_sse([enc.start()] + [f for ev in EVENTS for f in enc.event(ev)])
    names = [n for n, _ in events]
    dispatches = [(i, d) for i, (n, d) in enumerate(events) if n == "tool_call_dispatch"]
    assert len(dispatches) == 2
    final_idx = next(i for i, (n, d) in enumerate(events) if n is None and d != "[DONE]" and d["choices"][0]["finish_reason"])
    assert all(i < final_idx for i, _ in dispatches)
    first = dispatches[0][1]
    assert first == {"choice_index": 0, "tool_call": {"index": 0, "id": "call_a", "type": "function",
                                                      "function": {"name": "ls", "arguments": "{\"p\": 1}"}}}
    json.loads(first["tool_call"]["function"]["arguments"])
    # Once per call, in call order, each the moment its arguments are complete: after that call's last chunk
    # and before the next call's first one.
    assert [d["tool_call"]["id"] for _, d in dispatches] == ["call_a", "call_b"]
    assert names.count("tool_call_dispatch") == 2

    def call_chunks(index):
        return [i for i, (n, d) in enumerate(events) if n is None and d != "[DONE]"
                for ch in d["choices"] for tc in ch["delta"].get("tool_calls") or [] if tc["index"] == index]

    a_chunks, b_chunks = call_chunks(0), call_chunks(1)
    assert max(a_chunks) < dispatches[0][0] < min(b_chunks)
    assert max(b_chunks) < dispatches[1][0]


def test_no_dispatch_events_when_off():
    enc = ChatStreamEncoder("m", "r1")
    assert all(n is None for n, _ in parse_sse([f for ev in EVENTS for f in enc.event(ev)]))


def test_engine_error_mid_stream_is_an_error_frame_then_done():
    enc = ChatStreamEncoder("m", "r1")
    events = parse_sse(enc.event(TextDelta("a")) + enc.event(Finish("error", error="boom", error_kind="api_error")))
    assert events[1][1]["error"]["message"] == "boom"
    assert events[-1] == (None, "[DONE]")


@pytest.mark.parametrize("kind,status,etype,code", [("overloaded", 503, "service_unavailable_error",
                                                       "server_is_overloaded"),
                                                      ("api_error", 500, "server_error", None)])
def test_an_error_mid_stream_has_the_type_and_code_of_the_same_error_answered_before_output(kind, status, etype, code):
    """An overload after the first token (a replica's engine queue filled, the route was lost) is the same error as
    the 503 a request refused before any output gets: OpenAI's type and code, which clients branch on."""
    from serve_app.errors import ServiceError
    from serve_app.ingress import sse
    from serve_app.ingress.openai_errors import error_response

    fail = Finish("error", error="the engine queue is full, retry shortly", error_kind=kind)
    before = error_response(sse.refusal(fail))  # the non-stream / refused-before-output answer
    enc = ChatStreamEncoder("m", "r1")
    events = parse_sse(enc.event(TextDelta("a")) + enc.event(fail))
    assert events[-1] == (None, "[DONE]")
    err = events[-2][1]["error"]
    assert before.status_code == status and json.loads(before.body)["error"] == err
    assert err["type"] == etype and err["code"] == code
    # Folded (not streamed), a failure after output raises that error too, with its code and retry-after.
    with pytest.raises(ServiceError) as e:
        completion_body("m", "r1", [TextDelta("a"), fail])
    assert (e.value.kind, e.value.code) == (kind, code)


def test_empty_deltas_are_not_sent():
    enc = ChatStreamEncoder("m", "r1")
    assert enc.event(TextDelta("")) == [] and enc.event(ReasoningDelta("")) == []


def test_stream_chunks_are_the_json_of_the_whole_chunk_byte_for_byte():
    """The encoder writes the constant part of each chunk once per stream; the bytes must still be exactly
    json.dumps of the whole chunk, whatever the model id or the delta contains."""
    import json

    from serve_app.ingress.chat.encode import ChatStreamEncoder

    def whole(enc, delta, finish):
        body = {"id": enc.id, "object": "chat.completion.chunk", "created": enc.created, "model": enc.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if enc.include_usage:
            body["usage"] = None
        return ("data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")) + "\n\n").encode()

    texts = ['hé"llo\n\u2028', "\\ back\\slash \t\x00\x1f", "emoji 🙂 and 中文", "</script>", " "]
    for include_usage in (False, True):
        enc = ChatStreamEncoder('org/mo"dél\n', "rid", include_usage=include_usage)
        for delta, finish in [({"content": texts[0]}, None), ({}, "stop"),
                              ({"role": "assistant", "content": ""}, None),
                              ({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\": 1}"}}]}, None)]:
            assert enc._chunk(delta, finish) == whole(enc, delta, finish)
        # the per-token fast path for text and reasoning, before and after the stream's head is built
        fresh = ChatStreamEncoder("m", "rid2", include_usage=include_usage)
        for text in texts:
            assert fresh.event(TextDelta(text)) == [whole(fresh, {"content": text}, None)]
            assert enc.event(ReasoningDelta(text)) == [whole(enc, {"reasoning_content": text}, None)]


def test_a_message_without_content_is_a_400_except_an_assistants_with_tool_calls():
    from serve_app.errors import ServiceError
    from serve_app.ingress.chat.convert import chat_request_to_conversation

    for role in ("user", "system", "developer", "tool"):
        msgs = [{"role": "user", "content": "hi"}, {"role": role, "tool_call_id": "c"}]
        with pytest.raises(ServiceError) as e:
            chat_request_to_conversation({"model": "m", "messages": msgs})
        assert (e.value.status, e.value.kind, e.value.param) == (400, "invalid_request", "messages.1")
        assert e.value.message == f"messages.1: content: field required for a {role} message"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chat_request_to_conversation({"model": "m", "messages": [{"role": "user", "content": "x"},
                                                              {"role": "assistant", "tool_calls": [call]},
                                                              {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})


def test_a_tool_message_must_answer_a_call_of_the_assistant_turn_it_follows():
    from serve_app.errors import ServiceError
    from serve_app.ingress.chat.convert import chat_request_to_conversation

    def call(cid):
        return {"id": cid, "type": "function", "function": {"name": "f", "arguments": "{}"}}

    def tool(cid):
        return {"role": "tool", "tool_call_id": cid, "content": "ok"}

    user = {"role": "user", "content": "x"}
    asked = {"role": "assistant", "tool_calls": [call("c1"), call("c2")]}
    _, conv, _ = chat_request_to_conversation({"model": "m", "messages": [user, asked, tool("c2"), tool("c1")]})
    assert [m.role for m in conv.messages] == ["user", "assistant", "tool", "tool"]
    cases = [
        ([user, tool("c1")], 1, "role", "messages with role 'tool' must be a response to a preceeding message "
                                        "with 'tool_calls'."),
        ([user, asked, tool("c1"), user, tool("c2")], 4, "role", "must be a response to a preceeding message"),
        ([user, {"role": "assistant", "content": "no calls"}, tool("c1")], 2, "role", "preceeding message"),
        ([user, asked, tool("c3")], 2, "tool_call_id",
         "Invalid parameter: 'tool_call_id' of 'c3' not found in 'tool_calls' of previous message."),
    ]
    for messages, at, field, wording in cases:
        with pytest.raises(ServiceError) as e:
            chat_request_to_conversation({"model": "m", "messages": messages})
        assert (e.value.status, e.value.kind, e.value.param) == (400, "invalid_request", f"messages.[{at}].{field}")
        assert e.value.message.startswith("Invalid parameter: ") and wording in e.value.message


def test_an_assistant_refusal_part_in_history_is_its_text():
    from serve_app.conversation import TextPart
    from serve_app.ingress.chat.convert import chat_request_to_conversation

    _, conv, _ = chat_request_to_conversation({"model": "m", "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
        {"role": "user", "content": "ok"}]})
    assert conv.messages[1].parts == [TextPart("I can't help with that.")]
    with pytest.raises(InvalidRequest) as e:  # a user cannot send one
        chat_request_to_conversation({"model": "m", "messages": [
            {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]})
    assert e.value.param == "messages.0.content.0.type"


def test_continue_final_message_is_vllms_prefill():
    from serve_app.ingress.chat.convert import chat_request_to_conversation

    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "The answer is ("}]
    _, _, opts = chat_request_to_conversation({"model": "m", "messages": msgs})
    assert opts.continue_final is False  # OpenAI's own semantics: a new assistant turn
    _, _, opts = chat_request_to_conversation({"model": "m", "messages": msgs, "continue_final_message": True})
    assert opts.continue_final is True
    with pytest.raises(InvalidRequest) as e:
        chat_request_to_conversation({"model": "m", "messages": msgs[:1], "continue_final_message": True})
    assert e.value.param == "continue_final_message"


def _call_deltas(events):
    return [tc for name, d in events if name is None and d != "[DONE]" for ch in d["choices"]
            for tc in ch["delta"].get("tool_calls") or []]


def test_held_calls_go_out_whole_at_their_end_and_fold_the_same():
    enc = ChatStreamEncoder("m", "r1", include_usage=True, hold_calls=True)
    frames = [enc.start()]
    sent_before_end = []
    for ev in EVENTS:
        out = enc.event(ev)
        if isinstance(ev, ToolCallArgsDelta):
            sent_before_end += out
        frames += out
    assert sent_before_end == []  # nothing of a call goes out while it streams
    events = parse_sse(frames)
    assert _call_deltas(events) == [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "ls", "arguments": ""}},
        {"index": 0, "function": {"arguments": "{\"p\": 1}"}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "cat", "arguments": ""}},
        {"index": 1, "function": {"arguments": "{}"}},
    ]
    content, reasoning, calls, finish, _ = fold_chunks(events)
    message = completion_body("m", "r1", EVENTS)["choices"][0]["message"]
    assert (content, reasoning) == (message["content"], message["reasoning_content"])
    assert [calls[i] for i in sorted(calls)] == [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message["tool_calls"]]


def test_a_held_call_the_parser_abandons_is_never_sent_and_its_text_is():
    abandoned = [ToolCallStart(0, "call_a", "write"), ToolCallArgsDelta(0, "{\"path\": \"a.py\", \"content\": \"x"),
                 TextDelta("<tool_call>{\"name\": \"write\", \"arguments\": {\"path\": \"a.py\", \"content\": \"x"),
                 Finish("length")]
    held = ChatStreamEncoder("m", "r1", hold_calls=True)
    events = parse_sse([f for ev in abandoned for f in held.event(ev)])
    assert _call_deltas(events) == []
    assert "".join(d["choices"][0]["delta"].get("content") or "" for n, d in events if d != "[DONE]") \
        == abandoned[2].text
    streamed = ChatStreamEncoder("m", "r1")  # the default: arguments as generated, so this call's partial ones
    assert [tc["function"]["arguments"] for tc in _call_deltas(parse_sse(
        [f for ev in abandoned for f in streamed.event(ev)]))] == ["", abandoned[1].arguments]


def test_a_held_dispatch_still_announces_each_call_once_complete():
    enc = ChatStreamEncoder("m", "r1", dispatch=True, hold_calls=True)
    events = parse_sse([f for ev in EVENTS for f in enc.event(ev)])
    assert [d["tool_call"]["function"]["arguments"] for n, d in events if n == "tool_call_dispatch"] \
        == ["{\"p\": 1}", "{}"]
