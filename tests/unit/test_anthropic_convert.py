"""Anthropic wire request → Conversation/GenerationOptions: everything Claude Code 2.1 and OpenClaw send."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serve_app.conversation import (
    DocumentPart,
    Finish,
    ImagePart,
    ReasoningDelta,
    ReasoningPart,
    TextDelta,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    Usage,
)
from serve_app.errors import ServiceError
from serve_app.ingress.anthropic import signatures
from serve_app.ingress.anthropic.convert import (
    count_tokens_request,
    ir_tool_id,
    messages_request,
    thinking_omitted,
    to_conversation,
    wire_tool_id,
)
from serve_app.ingress.anthropic.encode import MessageEncoder, fold
from serve_app.ingress.responses.reasoning_crypto import ReasoningSealer

SECRET = b"s" * 32
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.abc; cc_entrypoint=cli;"


def conv_of(body, headers=None):
    base = {"model": "m", "max_tokens": 32000}
    base.update(body)
    return to_conversation(messages_request(base), SECRET, headers)


def test_claude_code_first_request_shape_is_accepted():
    body = {
        "model": "m",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": BILLING},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral", "ttl": "1h", "scope": "global"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "<system-reminder>mid-conversation</system-reminder>"},
        ],
        "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object", "properties": {}},
                   "cache_control": {"type": "ephemeral"}, "strict": True, "defer_loading": False,
                   "eager_input_streaming": True}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "adaptive", "display": "summarized"},
        "output_config": {"effort": "high", "task_budget": 5},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "sess-1"})},
        "speed": "fast",
        "diagnostics": {"x": 1},
    }
    conv, opts = to_conversation(messages_request(body), SECRET, {})
    assert conv.messages[0].role == "system"
    assert [p.text for p in conv.messages[0].parts] == [BILLING, "You are Claude Code, Anthropic's official CLI for Claude."]
    assert [m.role for m in conv.messages] == ["system", "user", "system"]
    assert conv.tools[0].name == "Bash" and conv.tools[0].parameters == {"type": "object", "properties": {}}
    assert opts.thinking is True and opts.reasoning_effort == "high"
    assert opts.session_key == "sess-1"
    assert opts.max_tokens == 32000  # never refused for size: the service clamps


@pytest.mark.parametrize("thinking,expected", [(None, False), ({"type": "disabled"}, False),
                                               ({"type": "enabled", "budget_tokens": 1024}, True),
                                               ({"type": "adaptive"}, True)])
def test_thinking_defaults_off(thinking, expected):
    body = {"messages": [{"role": "user", "content": "x"}]}
    if thinking:
        body["thinking"] = thinking
    assert conv_of(body)[1].thinking is expected


def test_session_header_wins_over_metadata():
    body = {"messages": [{"role": "user", "content": "x"}], "metadata": {"user_id": '{"session_id": "a"}'}}
    assert conv_of(body, {"x-claude-code-session-id": "hdr"})[1].session_key == "hdr"
    assert conv_of(body, {})[1].session_key == "a"
    plain = {"messages": [{"role": "user", "content": "x"}], "metadata": {"user_id": "user-7"}}
    assert conv_of(plain)[1].session_key == "user-7"


@pytest.mark.parametrize("user_id, user_key", [
    ('{"device_id": "d1", "account_uuid": "acc-1", "session_id": "s1"}', "acc-1/d1"),  # Claude Code now
    ('{"device_id": "d1", "account_uuid": "", "session_id": "s2"}', "d1"),  # no account (an API key's user)
    ("user_abc123_account_acc-1_session_s1", "user_abc123_account_acc-1"),  # Claude Code before its JSON
    ("user-7", "user-7"),
    ('{"session_id": "s1"}', None),  # nothing but the session: no one to tell apart
    (None, None),
])
def test_the_user_key_is_user_id_without_its_session(user_id, user_key):
    """The same user's sessions share a user key (the front door's guess at a first turn's tenant); the session
    key stays the session's own."""
    body = {"messages": [{"role": "user", "content": "x"}], "metadata": {"user_id": user_id}}
    assert conv_of(body)[1].user_key == user_key


def test_sampling_fields_and_forced_script():
    _, opts = conv_of({"messages": [{"role": "user", "content": "x"}], "temperature": 0.2, "top_p": 0.9, "top_k": 5,
                       "stop_sequences": ["END", ""], "nvext": {"forced_script": "hi", "agent_hints": {"osl": 12}}})
    assert (opts.temperature, opts.top_p, opts.top_k, opts.stop) == (0.2, 0.9, 5, ["END"])
    assert opts.forced_script == "hi" and opts.hints.osl == 12


def test_tool_loop_history_maps_to_calls_and_tool_messages_in_order():
    sig = signatures.sign(SECRET, "I should run ls")
    conv, _ = conv_of({"messages": [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should run ls", "signature": sig, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Running."},
            {"type": "tool_use", "id": "toolu_abc", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "toolu_def", "name": "Bash", "input": {"command": "pwd"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_abc", "content": "a.txt"},
            {"type": "tool_result", "tool_use_id": "toolu_def", "is_error": True,
             "content": [{"type": "text", "text": "boom"}, {"type": "text", "text": "again"}]},
            {"type": "text", "text": "now summarise"},
        ]},
    ]})
    assert [m.role for m in conv.messages] == ["user", "assistant", "tool", "tool", "user"]
    asst = conv.messages[1].parts
    assert asst[0] == ReasoningPart("I should run ls", signature=sig)
    assert asst[1] == TextPart("Running.")
    assert asst[2] == ToolCallPart(id="call_abc", name="Bash", arguments='{"command": "ls"}')
    r1, r2 = conv.messages[2].parts[0], conv.messages[3].parts[0]
    assert r1 == ToolResultPart(tool_call_id="call_abc", content="a.txt", is_error=False)
    assert r2.tool_call_id == "call_def" and r2.is_error and r2.content == [TextPart("boom"), TextPart("again")]
    assert conv.messages[4].parts == [TextPart("now summarise")]


def test_tampered_or_foreign_thinking_is_refused_with_the_api_wording():
    sig = signatures.sign(SECRET, "original")
    for thinking, signature in [("edited", sig), ("original", "EuYBCkQYAiJA" + "x" * 40), ("original", sig[:-2] + "AA")]:
        with pytest.raises(ServiceError) as e:
            conv_of({"messages": [{"role": "user", "content": "q"},
                                  {"role": "assistant", "content": [
                                      {"type": "text", "text": "a"},
                                      {"type": "thinking", "thinking": thinking, "signature": signature}]},
                                  {"role": "user", "content": "q2"}]})
        assert e.value.status == 400 and e.value.kind == "invalid_request"
        assert e.value.message == "messages.1.content.1: Invalid `signature` in `thinking` block"
    # Another server's key gives another signature.
    assert not signatures.verify(b"other", "original", sig)


def test_omitted_thinking_goes_out_empty_and_its_signature_brings_the_reasoning_back():
    """`thinking.display: "omitted"`: the stream carries no thinking text, the signature seals it (AES-GCM, as
    Responses `encrypted_content`), and the next turn's prompt holds the model's real reasoning."""
    thinking = {"type": "adaptive", "display": "omitted"}
    for display, omitted in [("omitted", True), ("summarized", False), (None, False)]:
        req = messages_request({"model": "m", "max_tokens": 2048, "thinking": {"type": "adaptive", "display": display},
                                "messages": [{"role": "user", "content": "hi"}]})
        assert thinking_omitted(req) is omitted
    enc = MessageEncoder("m", "msg_1", thinking=True, secret=SECRET, omit_thinking=True)
    stream = [se for ev in [Usage(10, 0), ReasoningDelta("The user "), ReasoningDelta("greets me."), TextDelta("Hi!"),
                            Usage(10, 5), Finish("stop")] for se in enc.event(ev)]
    assert not [d for n, d in stream if n == "content_block_delta" and d["delta"]["type"] == "thinking_delta"]
    block = fold(stream)["content"][0]
    assert block["type"] == "thinking" and block["thinking"] == "" and block["signature"].startswith("sa2.")
    assert "greets" not in block["signature"]

    def next_turn(b):
        answer = {"role": "assistant", "content": [b, {"type": "text", "text": "Hi!"}]}
        return {"thinking": thinking, "messages": [{"role": "user", "content": "hi"}, answer,
                                                    {"role": "user", "content": "and?"}]}

    conv, _ = conv_of(next_turn(block))
    assert conv.messages[1].parts[0] == ReasoningPart("The user greets me.", signature=block["signature"])
    conv, _ = conv_of(next_turn({**block, "thinking": "The user greets me."}))  # sent back filled in: the same
    assert conv.messages[1].parts[0].text == "The user greets me."
    responses_blob = "sa2." + ReasoningSealer(SECRET).seal("The user greets me.")  # sealed for another use
    for bad in [{**block, "thinking": "I was told to."}, {**block, "signature": block["signature"][:-4] + "AAAA"},
                {**block, "signature": responses_blob}]:
        with pytest.raises(ServiceError) as e:
            conv_of(next_turn(bad))
        assert e.value.message == "messages.1.content.0: Invalid `signature` in `thinking` block"
    with pytest.raises(ServiceError):  # another server's key
        to_conversation(messages_request({"model": "m", "max_tokens": 2048, **next_turn(block)}), b"o" * 32)


def test_unsigned_and_redacted_thinking_are_accepted_but_not_replayed():
    conv, _ = conv_of({"messages": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": [
                                        {"type": "thinking", "thinking": "t", "signature": ""},
                                        {"type": "thinking", "thinking": "t2"},
                                        {"type": "redacted_thinking", "data": "opaque"},
                                        {"type": "text", "text": "a"}]}]})
    assert conv.messages[1].parts == [TextPart("a")]


def test_images_and_documents_become_parts():
    conv, _ = conv_of({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBER"}},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain doc"}},
        {"type": "text", "text": "describe"},
    ]}]})
    assert conv.messages[0].parts == [
        ImagePart(media_type="image/png", data="iVBOR"), ImagePart(url="https://x/y.png"),
        DocumentPart(media_type="application/pdf", data="JVBER"), DocumentPart(media_type="text/plain", text="plain doc"),
        TextPart("describe"),
    ]


def refusal(body, count=False):
    with pytest.raises(ServiceError) as e:
        if count:
            to_conversation(count_tokens_request({"model": "m", **body}), SECRET)
        else:
            conv_of(body)
    assert e.value.status == 400 and e.value.kind == "invalid_request"
    return e.value


@pytest.mark.parametrize("count", [False, True])
def test_an_unknown_block_type_is_a_400_in_the_apis_words_never_dropped(count):
    err = refusal({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                             {"type": "future_block", "x": 1}]}]}, count)
    assert err.param == "messages.0.content.1.type"
    assert err.message.startswith("messages.0.content.1: Input tag 'future_block' found using 'type' does not match "
                                  "any of the expected tags: ")
    assert "'search_result'" in err.message and "'tool_result'" in err.message
    # Inside a tool_result too: the list is the one tool_result content allows.
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]}
    err = refusal({"messages": [{"role": "user", "content": "go"}, use, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "video", "url": "x"}]}]}]}, count)
    assert err.message == ("messages.2.content.0.content.0: Input tag 'video' found using 'type' does not match any "
                           "of the expected tags: 'browser_state', 'document', 'image', 'search_result', 'text', "
                           "'tool_reference'")


@pytest.mark.parametrize("block", [
    {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": []},
    {"type": "container_upload", "file_id": "f"},
    {"type": "mcp_tool_use", "id": "m", "name": "x", "server_name": "s", "input": {}},
    {"type": "compaction", "content": "summary"},
])
def test_documented_server_side_blocks_are_refused_by_name(block):
    err = refusal({"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": [block]}]})
    assert err.message.startswith(f"messages.1.content.0: `{block['type']}` blocks are not supported by this server")


def test_a_search_result_renders_with_its_title_and_source():
    sr = {"type": "search_result", "source": "https://example.com/paris", "title": "Paris weather",
          "content": [{"type": "text", "text": "Sunny."}, {"type": "text", "text": "21 C."}],
          "citations": {"enabled": True}, "cache_control": {"type": "ephemeral"}}
    conv, _ = conv_of({"messages": [{"role": "user", "content": [sr, {"type": "text", "text": "Weather?"}]}]})
    assert conv.messages[0].parts == [
        DocumentPart(media_type="text/plain", text="Sunny.\n21 C.", title="Paris weather",
                     source="https://example.com/paris"), TextPart("Weather?")]
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "search", "input": {}}]}
    conv, _ = conv_of({"messages": [{"role": "user", "content": "go"}, use, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [sr]}]}]})
    assert conv.messages[-1].parts[0].content[0].title == "Paris weather"


def test_text_documents_keep_title_and_context_and_content_sources_keep_their_images():
    doc = {"type": "document", "title": "Notes", "context": "from the wiki",
           "source": {"type": "content", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                                                     {"type": "image", "source": {"type": "url", "url": "u"}}]}}
    conv, _ = conv_of({"messages": [{"role": "user", "content": [doc]}]})
    assert conv.messages[0].parts == [DocumentPart(media_type="text/plain", text="a\nb", title="Notes",
                                                   context="from the wiki"), ImagePart(url="u")]
    doc["source"]["content"].append({"type": "audio"})
    assert refusal({"messages": [{"role": "user", "content": [doc]}]}).param == "messages.0.content.0.source.content.3.type"


@pytest.mark.parametrize("thinking,max_tokens,param,message", [
    ({"type": "enabled"}, 4096, "thinking.budget_tokens", "thinking.enabled.budget_tokens: Field required"),
    ({"type": "enabled", "budget_tokens": 100}, 4096, "thinking.budget_tokens",
     "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"),
    ({"type": "enabled", "budget_tokens": 100}, 2, "max_tokens",
     "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our documentation at "
     "https://docs.claude.com/en/docs/build-with-claude/extended-thinking#max-tokens-and-context-window-size"),
    ({"type": "enabled", "budget_tokens": 2048}, 2048, "max_tokens", "`max_tokens` must be greater than"),
])
def test_thinking_budget_rules(thinking, max_tokens, param, message):
    with pytest.raises(ServiceError) as e:
        conv_of({"max_tokens": max_tokens, "thinking": thinking, "messages": [{"role": "user", "content": "x"}]})
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(message)


@pytest.mark.parametrize("thinking,max_tokens", [
    ({"type": "enabled", "budget_tokens": 1024}, 1025),
    ({"type": "enabled", "budget_tokens": 31999}, 32000),  # Claude Code: min(budget, max_tokens - 1)
    ({"type": "enabled", "budget_tokens": 511}, 512),  # the same with CLAUDE_CODE_MAX_OUTPUT_TOKENS=512
    ({"type": "adaptive", "display": "summarized"}, 1),  # OpenClaw and Claude Code's default: no budget
    ({"type": "between_tools"}, 100),
    ({"type": "disabled", "budget_tokens": 5}, 100),
])
def test_thinking_requests_harnesses_send_are_accepted(thinking, max_tokens):
    _, opts = conv_of({"max_tokens": max_tokens, "thinking": thinking, "messages": [{"role": "user", "content": "x"}]})
    assert opts.thinking is (thinking["type"] in ("enabled", "adaptive"))  # between_tools is thinking off


def test_count_tokens_applies_the_budget_minimum_but_has_no_max_tokens():
    body = {"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "enabled", "budget_tokens": 1024}}
    to_conversation(count_tokens_request({"model": "m", **body}), SECRET)  # Claude Code's count_tokens body
    body["thinking"]["budget_tokens"] = 1023
    assert refusal(body, count=True).param == "thinking.budget_tokens"


@pytest.mark.parametrize("count", [False, True])
def test_a_final_assistant_message_is_continued(count):
    body = {"messages": [{"role": "user", "content": "Greek name for the Sun? (A) Sol (B) Helios"},
                         {"role": "assistant", "content": "The best answer is ("}]}
    conv, opts = (to_conversation(count_tokens_request({"model": "m", **body}), SECRET) if count else conv_of(body))
    assert opts.continue_final is True
    assert conv.messages[-1].role == "assistant" and conv.messages[-1].parts == [TextPart("The best answer is (")]
    body["messages"][-1]["content"] = [{"type": "text", "text": "The best answer is "}]
    if count:  # Claude Code counts conversations ending with its own answers: never a 400 there
        assert to_conversation(count_tokens_request({"model": "m", **body}), SECRET)[1].continue_final is True
    else:
        assert refusal(body).message == "messages: final assistant content cannot end with trailing whitespace"


def test_an_empty_final_assistant_message_starts_a_new_turn():
    for empty in ("", []):
        conv, opts = conv_of({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": empty}]})
        assert opts.continue_final is False and [m.role for m in conv.messages] == ["user"]
    _, opts = conv_of({"messages": [{"role": "user", "content": "hi"}]})
    assert opts.continue_final is False


def test_a_final_assistant_message_ending_in_a_tool_use_is_refused_and_counted():
    body = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": [
        {"type": "text", "text": "Running it."}, {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]}]}
    err = refusal(body)
    assert err.param == "messages.1" and "ends with a tool_use block" in err.message
    conv, opts = to_conversation(count_tokens_request({"model": "m", **body}), SECRET)
    assert opts.continue_final is False and conv.messages[-1].role == "assistant"  # counted as a complete turn


@pytest.mark.parametrize("tc,mode,name,parallel", [
    ({"type": "auto"}, "auto", None, True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", None, False),
    ({"type": "tool", "name": "Bash"}, "tool", "Bash", True),
    ({"type": "none"}, "none", None, True),
])
def test_tool_choice(tc, mode, name, parallel):
    conv, _ = conv_of({"messages": [{"role": "user", "content": "x"}], "tool_choice": tc,
                       "tools": [{"name": "Bash", "input_schema": {"type": "object"}}]})
    assert (conv.tool_choice.mode, conv.tool_choice.name, conv.tool_choice.parallel) == (mode, name, parallel)


def test_server_tools_get_a_clean_400():
    with pytest.raises(ServiceError) as e:
        conv_of({"messages": [{"role": "user", "content": "x"}],
                 "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]})
    assert e.value.status == 400 and "tools.0" in e.value.message


@pytest.mark.parametrize("body,where", [
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0.text: Field required"),
    ({"model": "m", "max_tokens": "lots", "messages": []}, "max_tokens: Input should be a valid integer"),
    ({"model": "m", "messages": []}, "max_tokens: Field required"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]}, "messages.0.role: Input should be"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "thinking": {"type": "maybe"}},
     "thinking.type: Input should be"),
])
def test_validation_errors_name_the_field(body, where):
    with pytest.raises(ServiceError) as e:
        messages_request(body)
    assert e.value.status == 400 and e.value.message.startswith(where)


def test_count_tokens_body_needs_no_max_tokens():
    req = count_tokens_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                "thinking": {"type": "enabled", "budget_tokens": 2000}})
    conv, opts = to_conversation(req, SECRET)
    assert opts.thinking is True and opts.max_tokens is None and conv.messages[0].parts == [TextPart("x")]


@given(st.text(min_size=1, max_size=40))
def test_tool_ids_round_trip_and_are_anthropic_safe(call_id):
    wid = wire_tool_id(call_id)
    assert wid.startswith("toolu_")
    assert all(c.isascii() and (c.isalnum() or c in "_-") for c in wid)
    assert ir_tool_id(wid) == call_id or (call_id.startswith("toolu_") and ir_tool_id(wid) == "call_" + call_id[6:])
    assert ir_tool_id(wire_tool_id(ir_tool_id(wid))) == ir_tool_id(wid)


def test_model_generated_ids_survive_the_round_trip():
    for cid in ["call_0123abcd", "functions.Bash:0", "tool-1"]:
        assert ir_tool_id(wire_tool_id(cid)) == cid


def test_a_tool_result_must_answer_a_tool_use_of_the_message_just_before():
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]}

    def result(tid):
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tid, "content": "ok"}]}

    paired, _ = conv_of({"messages": [{"role": "user", "content": "go"}, use, result("toolu_1")]})
    assert [m.role for m in paired.messages] == ["user", "assistant", "tool"]
    for messages in ([{"role": "user", "content": "go"}, use, result("toolu_2")],  # answers nothing
                     [result("toolu_1")],  # nothing asked before
                     [{"role": "user", "content": "go"}, use, result("toolu_1"),
                      {"role": "assistant", "content": "sure"}, result("toolu_1")]):  # asked two turns back
        with pytest.raises(ServiceError) as e:
            conv_of({"messages": messages})
        where = f"messages.{len(messages) - 1}.content.0"
        assert e.value.status == 400 and e.value.param == where
        assert e.value.message.startswith(f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: toolu_")
        assert "must have a corresponding `tool_use` block in the previous message" in e.value.message


EMPTY = "messages: text content blocks must be non-empty"
BLANK = "messages: text content blocks must contain non-whitespace text"
TRAILING = "messages: final assistant content cannot end with trailing whitespace"


@pytest.mark.parametrize("count", [False, True])
def test_empty_and_blank_text_blocks_are_refused_in_the_apis_words(count):
    use = {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}
    answer = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}
    for messages, wording in [
        ([{"role": "user", "content": [{"type": "text", "text": ""}]}], EMPTY),
        ([{"role": "user", "content": [{"type": "text", "text": " \n"}]}], BLANK),
        ([{"role": "user", "content": " \n"}], BLANK),
        ([{"role": "user", "content": "go"}, {"role": "assistant", "content": [{"type": "text", "text": ""}, use]},
          answer], EMPTY),  # what OpenClaw once stored next to a tool call
        ([{"role": "user", "content": "go"}, {"role": "assistant", "content": [{"type": "text", "text": "\n\n"}, use]},
          answer], BLANK),
        ([{"role": "user", "content": "go"}, {"role": "assistant", "content": [{"type": "text", "text": ""}]}], EMPTY),
        ([{"role": "user", "content": "go"}, {"role": "assistant", "content": [
            {"type": "text", "text": " "}, {"type": "text", "text": "The answer is"}]}], BLANK),
    ]:
        assert refusal({"messages": messages}, count=count).message == wording
    for system, wording in [([{"type": "text", "text": ""}], "system: text content blocks must be non-empty"),
                            ([{"type": "text", "text": "  "}],
                             "system: text content blocks must contain non-whitespace text")]:
        err = refusal({"system": system, "messages": [{"role": "user", "content": "x"}]}, count=count)
        assert err.message == wording and err.param == "system.0.text"


@pytest.mark.parametrize("content", ["  ", [{"type": "text", "text": "\n"}]])
def test_a_blank_prefill_is_trailing_whitespace(content):
    body = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": content}]}
    assert refusal(body).message == TRAILING
    to_conversation(count_tokens_request({"model": "m", **body}), SECRET)  # counted, as any tail is


@pytest.mark.parametrize("count", [False, True])
def test_only_assistant_messages_may_be_empty(count):
    for empty in ("", []):
        for messages, where in [([{"role": "user", "content": empty}], "messages.0"),
                                ([{"role": "user", "content": empty}, {"role": "assistant", "content": "a"},
                                  {"role": "user", "content": "b"}], "messages.0")]:
            err = refusal({"messages": messages}, count=count)
            assert err.param == where and err.message == (f"{where}: all messages must have non-empty content except "
                                                           f"for the optional final assistant message")
        # An assistant turn that came back empty (a small model can end one with nothing) is sent back as it came
        body = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": empty},
                             {"role": "user", "content": "b"}]}
        conv, _ = (to_conversation(count_tokens_request({"model": "m", **body}), SECRET) if count else conv_of(body))
        assert [m.parts for m in conv.messages if m.role == "user"] == [[TextPart("a")], [TextPart("b")]]


def test_max_tokens_zero_is_a_prewarm_and_below_zero_is_refused():
    user = [{"role": "user", "content": "x"}]
    _, opts = conv_of({"max_tokens": 0, "messages": user})
    assert opts.max_tokens == 1  # the engine makes one token, which the answer does not show (test_anthropic_routes)
    err = refusal({"max_tokens": -1, "messages": user})
    assert err.param == "max_tokens" and err.message == "max_tokens: Input should be greater than or equal to 0"
    fmt = {"format": {"type": "json_schema", "schema": {"type": "object"}}}
    for extra, param in [({"stream": True}, "stream"), ({"thinking": {"type": "adaptive"}}, "thinking"),
                         ({"output_config": fmt}, "output_config.format")]:
        err = refusal({"max_tokens": 0, "messages": user, **extra})  # what the API says a pre-warm cannot do
        assert err.param == param and err.message.startswith("max_tokens: 0 (cache pre-warming) cannot be combined")


def test_every_tool_use_is_answered_in_the_message_right_after_it():
    """The API's reverse pairing rule and wording: the message after a tool_use answers every id of it."""
    use = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}},
        {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {}},
        {"type": "tool_use", "id": "toolu_3", "name": "Bash", "input": {}}]}

    def results(*ids):
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": t, "content": "ok"} for t in ids]}

    go = {"role": "user", "content": "go"}
    for messages, missing in [
        ([go, use, results("toolu_2")], "toolu_1, toolu_3"),  # answered in part
        ([go, use, {"role": "user", "content": "never mind"}], "toolu_1, toolu_2, toolu_3"),  # not at all
        ([go, use, {"role": "assistant", "content": "hm"}, results("toolu_1", "toolu_2", "toolu_3")],
         "toolu_1, toolu_2, toolu_3"),  # answered, but not immediately after
    ]:
        for count in (False, True):  # count_tokens applies the same rule
            err = refusal({"messages": messages}, count=count)
            assert err.param == "messages.1"
            assert err.message == (f"messages.1: `tool_use` ids were found without `tool_result` blocks immediately "
                                   f"after: {missing}. Each `tool_use` block must have a corresponding `tool_result` "
                                   f"block in the next message.")
    conv, _ = conv_of({"messages": [go, use, results("toolu_3", "toolu_1", "toolu_2")]})  # any order
    assert [m.role for m in conv.messages] == ["user", "assistant", "tool", "tool", "tool"]


def test_a_trailing_tool_use_is_not_an_unanswered_one():
    """The last message has no message after it: Claude Code counts conversations that end with its own tool call
    (`/context`), and a final assistant message is a prefill's business (refused by name on `messages`, above)."""
    body = {"messages": [{"role": "user", "content": "go"},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                                            "input": {}}]}]}
    conv, opts = to_conversation(count_tokens_request({"model": "m", **body}), SECRET)
    assert opts.continue_final is False and isinstance(conv.messages[-1].parts[-1], ToolCallPart)
    assert "`tool_use` ids were found" not in refusal(body).message


@pytest.mark.parametrize("tc", [{"type": "any"}, {"type": "tool", "name": "Bash"}])
def test_thinking_with_a_forced_tool_is_refused_as_the_api_does(tc):
    body = {"messages": [{"role": "user", "content": "x"}], "tool_choice": tc, "max_tokens": 2048,
            "tools": [{"name": "Bash", "input_schema": {"type": "object"}}]}
    with pytest.raises(ServiceError) as e:
        conv_of({**body, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert e.value.status == 400 and e.value.message == "Thinking may not be enabled when tool_choice forces tool use."
    assert conv_of({**body, "tool_choice": {"type": "auto"}, "thinking": {"type": "enabled", "budget_tokens": 1024}})


def test_eager_tools_are_those_that_ask_or_all_under_the_fine_grained_beta():
    from serve_app.ingress.anthropic.convert import FINE_GRAINED_BETA, eager_tools

    body = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "Write", "input_schema": {"type": "object"}, "eager_input_streaming": True},
                      {"name": "Bash", "input_schema": {"type": "object"}},
                      {"name": "Read", "input_schema": {"type": "object"}, "eager_input_streaming": False}]}
    assert eager_tools(messages_request(body)) == {"Write"}
    assert eager_tools(messages_request(body), {"anthropic-beta": f"interleaved-thinking-2025-05-14,{FINE_GRAINED_BETA}"}) is None
    assert eager_tools(messages_request({**body, "betas": [FINE_GRAINED_BETA]})) is None
    assert eager_tools(messages_request({**body, "betas": 7})) == {"Write"}  # not a list: no beta named
    assert eager_tools(messages_request({**body, "tools": None})) == frozenset()
