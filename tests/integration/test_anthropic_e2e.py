"""Anthropic Messages through the whole path (Ray Serve proxy → Ingress → Router → vLLM engine), driven by the
real `anthropic` SDK. Exact outputs come from forced scripts through the real engine (`nvext.forced_script`)."""

from __future__ import annotations

import gzip
import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.integration

PLAIN = "smollm2-135m-instruct"  # no reasoning parser, hermes tools
CAPPED = "smollm2-capped"  # the same engine with a 6-token output cap
THINK = "test-qwen3"  # qwen3 reasoning parser + hermes tools
LONG = "claude-sonnet-4-6"  # alias of the 32K (YaRN) engine

BASH = {"name": "Bash", "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
READ = {"name": "Read", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
USER = [{"role": "user", "content": "go"}]


def call(name: str, args: dict) -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(args) + "}\n</tool_call>"


@pytest.fixture(scope="module")
def client(serve_url):
    return anthropic.Anthropic(base_url=serve_url, api_key="unused", max_retries=0, timeout=600)


def forced(script: str) -> dict:
    return {"nvext": {"forced_script": script}}


def test_real_model_answers(client):
    m = client.messages.create(model=PLAIN, max_tokens=30, extra_body={"temperature": 0},  # not an SDK 2.x param
                               messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.content and m.content[0].type == "text" and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 30


def test_stream_accumulator_matches_create(client):
    script = "<think>Check the files first.</think>I'll look." + call("Bash", {"command": "ls -la"})
    args = dict(model=THINK, max_tokens=200, messages=USER, tools=[BASH], thinking={"type": "adaptive"},
                extra_body=forced(script))
    created = client.messages.create(**args)
    with client.messages.stream(**args) as s:
        names = [ev.type for ev in s]
        streamed = s.get_final_message()
    for m in (created, streamed):
        assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
        assert m.content[0].thinking == "Check the files first." and m.content[0].signature
        assert m.content[1].text == "I'll look."
        assert m.content[2].name == "Bash" and m.content[2].input == {"command": "ls -la"}
        assert m.content[2].id.startswith("toolu_")
        assert m.stop_reason == "tool_use"
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert streamed.usage.output_tokens == created.usage.output_tokens
    assert (streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens
            == created.usage.input_tokens + created.usage.cache_read_input_tokens)


def test_thinking_off_drops_reasoning(client):
    script = "<think>private</think>Visible." + call("Bash", {"command": "pwd"})
    m = client.messages.create(model=THINK, max_tokens=200, messages=USER, tools=[BASH], extra_body=forced(script))
    assert [b.type for b in m.content] == ["text", "tool_use"]
    assert "private" not in m.content[0].text


def test_count_tokens_equals_the_prompt_the_engine_saw(client):
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=cli;"},
              {"type": "text", "text": "You are a careful assistant. " * 20, "cache_control": {"type": "ephemeral"}}]
    kw = dict(model=THINK, system=system, tools=[BASH, READ], thinking={"type": "enabled", "budget_tokens": 1024},
              messages=[{"role": "user", "content": [{"type": "text", "text": "Say ok.",
                                                      "cache_control": {"type": "ephemeral"}}]}])
    counted = client.messages.count_tokens(**kw)
    m = client.messages.create(max_tokens=1025, extra_body=forced("ok"), **kw)  # budget_tokens < max_tokens
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    # System and tools are counted, not just the messages (CLIProxyAPI#679's undercount).
    no_tools = client.messages.count_tokens(**{k: v for k, v in kw.items() if k != "tools"})
    bare = client.messages.count_tokens(model=THINK, messages=kw["messages"])
    assert counted.input_tokens > no_tools.input_tokens > bare.input_tokens


def test_interleaved_think_tool_think_tool(client):
    script = ("<think>First read a.</think>" + call("Read", {"path": "a"})
              + "<think>Then read b.</think>" + call("Read", {"path": "b"}))
    with client.messages.stream(model=THINK, max_tokens=300, messages=USER, tools=[READ], thinking={"type": "adaptive"},
                                extra_body=forced(script)) as s:
        m = s.get_final_message()
    assert [b.type for b in m.content] == ["thinking", "tool_use", "thinking", "tool_use"]
    assert [b.input for b in m.content if b.type == "tool_use"] == [{"path": "a"}, {"path": "b"}]
    assert [b.thinking for b in m.content if b.type == "thinking"] == ["First read a.", "Then read b."]


def test_parallel_tool_calls(client):
    script = "Reading both." + call("Read", {"path": "x.py"}) + "\n" + call("Read", {"path": "y.py"})
    m = client.messages.create(model=PLAIN, max_tokens=300, messages=USER, tools=[READ], extra_body=forced(script))
    uses = [b for b in m.content if b.type == "tool_use"]
    assert [u.input for u in uses] == [{"path": "x.py"}, {"path": "y.py"}]
    assert len({u.id for u in uses}) == 2 and m.stop_reason == "tool_use"


def test_20kb_tool_argument_streams_in_many_fragments(client, serve_url):
    # ~21 KB in ~450 tokens: a run of 64 "=" is one token, so the forced decode (about 8 tokens/s on two CPU
    # cores) stays short while the argument still arrives in hundreds of fragments. The tool asks for its input
    # as generated (`eager_input_streaming`); without it the call goes out whole once complete
    # (tests/unit/test_anthropic_encode.py).
    content = "".join(f"section {i} " + "=" * 1024 + "\n" for i in range(20))
    assert len(content) > 20_000
    write = {"name": "Write", "eager_input_streaming": True, "input_schema": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}
    script = call("Write", {"path": "big.txt", "content": content})
    body = {"model": PLAIN, "max_tokens": 2048, "stream": True, "messages": USER, "tools": [write], **forced(script)}

    def raw_fragments() -> int:
        n = 0
        with httpx.stream("POST", f"{serve_url}/v1/messages?beta=true", json=body, timeout=600) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and '"input_json_delta"' in line:
                    n += 1
        return n

    def sdk_message():
        with client.messages.stream(model=PLAIN, max_tokens=2048, messages=USER, tools=[write],
                                    extra_body=forced(script)) as s:
            return s.get_final_message()

    with ThreadPoolExecutor(2) as pool:  # one batch: two decodes cost about one on two CPU cores
        fragments, m = pool.submit(raw_fragments), pool.submit(sdk_message)
        fragments, m = fragments.result(), m.result()
    assert fragments >= 20
    assert m.content[0].type == "tool_use" and m.content[0].input == {"path": "big.txt", "content": content}


def test_stop_sequence(client):
    m = client.messages.create(model=PLAIN, max_tokens=50, messages=USER, stop_sequences=["THREE"],
                               extra_body=forced("one two THREE four"))
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "THREE"
    assert m.content[0].text.startswith("one two") and "four" not in m.content[0].text


def test_max_tokens(client):
    m = client.messages.create(model=PLAIN, max_tokens=3, messages=USER,
                               extra_body=forced("a long answer that goes on and on and on"))
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_a_stop_at_the_deployments_output_cap_pauses_the_turn(client, serve_url):
    """`smollm2-capped` serves the 8K engine with a 6-token output cap. A client that allowed more gets
    `pause_turn` (the service's limit, not the client's: docs/limits.md), streamed and not; one whose own
    max_tokens binds gets `max_tokens`; Chat reports either as `length`."""
    args = dict(model=CAPPED, max_tokens=1000, messages=USER, extra_body=forced("one two three four five six seven"))
    with client.messages.stream(**args) as s:
        streamed = s.get_final_message()
    for m in (streamed, client.messages.create(**args)):
        assert m.stop_reason == "pause_turn" and m.usage.output_tokens == 6, m
        assert m.content[0].text.startswith("one two") and "seven" not in m.content[0].text
    own = client.messages.create(**{**args, "max_tokens": 3})
    assert own.stop_reason == "max_tokens" and own.usage.output_tokens == 3
    chat = httpx.post(f"{serve_url}/v1/chat/completions", timeout=120, json={
        "model": CAPPED, "max_tokens": 1000, "messages": USER, **args["extra_body"]})
    assert chat.json()["choices"][0]["finish_reason"] == "length" and chat.json()["usage"]["completion_tokens"] == 6


def test_context_full_is_model_context_window_exceeded(client):
    """About 8130 prompt tokens of the 8K engine's 8192 and max_tokens 200: the context fills first, streamed and
    not; the client's own max_tokens, below the room left, is still max_tokens (docs/limits.md)."""
    args = dict(model=PLAIN, max_tokens=200, messages=[{"role": "user", "content": "hi " * 8100}],
                extra_body=forced("story " * 300))
    with client.messages.stream(**args) as s:
        streamed = s.get_final_message()
    created = client.messages.create(**args)
    for m in (streamed, created):
        assert m.stop_reason == "model_context_window_exceeded" and m.content[0].text.startswith("story story")
        assert m.usage.output_tokens == 8192 - (m.usage.input_tokens + m.usage.cache_read_input_tokens) < 200
    m = client.messages.create(**{**args, "max_tokens": 5})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5


def test_huge_max_tokens_is_clamped_not_refused(client):
    m = client.messages.create(model=PLAIN, max_tokens=128000, messages=USER, extra_body=forced("fine"))
    assert m.content[0].text == "fine" and m.stop_reason == "end_turn"


def test_tool_loop_round_trips_signed_thinking_and_reuses_the_prefix(client):
    system = "You are a coding agent. " * 30
    first_script = "<think>I should list files.</think>" + call("Bash", {"command": "echo hi"})
    kw = dict(model=THINK, max_tokens=200, system=system, tools=[BASH], thinking={"type": "adaptive"})
    first = client.messages.create(messages=USER, extra_body=forced(first_script), **kw)
    use = first.content[-1]
    history = [USER[0], {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "hi"}]}]
    second = client.messages.create(messages=history, extra_body=forced("It printed hi."), **kw)
    assert second.content[-1].text == "It printed hi." and second.stop_reason == "end_turn"
    assert second.usage.cache_read_input_tokens > 0
    history[1]["content"][0]["thinking"] = "I should delete files."
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(messages=history, extra_body=forced("no"), **kw)
    assert "Invalid `signature` in `thinking` block" in str(e.value)


def test_claude_code_first_request_shape(client, serve_url):
    body = {
        "model": LONG, "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.f00; cc_entrypoint=cli;"},
                   {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                    "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}]},
                     {"role": "system", "content": "<system-reminder>today is Monday</system-reminder>"}],
        "tools": [{**BASH, "cache_control": {"type": "ephemeral"}, "eager_input_streaming": True}],
        "tool_choice": {"type": "auto"}, "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": "s-1"})},
        **forced("<think>Greet back.</think>Hello!"),
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
               "effort-2025-11-24,made-up-beta-2099-01-01", "x-claude-code-session-id": "s-1", "x-app": "cli"}
    events = []
    with httpx.stream("POST", f"{serve_url}/v1/messages?beta=true", json=body, headers=headers, timeout=600) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "signature_delta" not in events  # it is a delta type, carried under content_block_delta
    assert events.count("content_block_start") == 2


def test_errors_in_the_anthropic_envelope(client, serve_url):
    def check(r, status, etype):
        assert r.status_code == status, r.text
        j = r.json()
        assert j["type"] == "error" and j["error"]["type"] == etype
        assert r.headers["request-id"]
        return j["error"]["message"]

    url = f"{serve_url}/v1/messages"
    msg = check(httpx.post(url, json={"model": "no-such-model", "max_tokens": 5, "messages": USER}, timeout=60),
                404, "not_found_error")
    assert msg == "model: no-such-model"
    too_long = "lorem ipsum dolor sit amet " * 3000
    msg = check(httpx.post(url, json={"model": PLAIN, "max_tokens": 5, "messages": [
        {"role": "user", "content": too_long}]}, timeout=120), 400, "invalid_request_error")
    assert msg.startswith("prompt is too long: ") and msg.endswith(" tokens > 8192 maximum")
    msg = check(httpx.post(url, json={"model": PLAIN, "messages": USER}, timeout=60), 400, "invalid_request_error")
    assert msg.startswith("max_tokens")
    check(httpx.post(url, content=b"{", headers={"content-type": "application/json"}, timeout=60), 400,
          "invalid_request_error")
    bomb = gzip.compress(b" " * (65 * 1024 * 1024))  # ~64 KB on the wire, over the 64 MiB decompressed cap
    check(httpx.post(url, content=bomb, headers={"content-type": "application/json", "content-encoding": "gzip"},
                     timeout=120), 413, "request_too_large")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=5, messages=USER)


def test_models_in_anthropic_shape_and_head(client, serve_url):
    page = client.models.list(limit=1000)
    ids = [m.id for m in page.data]
    assert LONG in ids and PLAIN in ids
    m = client.models.retrieve(LONG)
    assert m.type == "model" and m.id == LONG
    raw = httpx.get(f"{serve_url}/v1/models", headers={"anthropic-version": "2023-06-01"}, params={"limit": 2},
                    timeout=60).json()
    assert set(raw) >= {"data", "has_more", "first_id", "last_id"} and raw["has_more"] is True
    assert raw["data"][0]["max_input_tokens"] > 0 and raw["data"][0]["max_tokens"] > 0
    assert httpx.head(f"{serve_url}/", timeout=60).status_code == 200


def test_invalid_input_is_refused_in_the_apis_words(client):
    """Validation parity (issue 14): each of these was accepted before; all are refused before the engine."""
    use = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]}
    cases = [
        (dict(messages=[*USER, use, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "x"}]}]),
         "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: toolu_2."),
        (dict(messages=[{"role": "user", "content": [{"type": "hologram", "data": "x"}]}]),
         "messages.0.content.0: Input tag 'hologram' found using 'type' does not match any of the expected tags:"),
        (dict(messages=USER, max_tokens=2, thinking={"type": "enabled", "budget_tokens": 100}),
         "`max_tokens` must be greater than `thinking.budget_tokens`."),
        (dict(messages=USER, thinking={"type": "enabled", "budget_tokens": 100}),
         "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"),
        (dict(messages=[*USER, use, {"role": "user", "content": "never mind"}]),
         "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after: toolu_1."),
        (dict(messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}]),
         "messages: text content blocks must be non-empty"),
    ]
    for kw, wording in cases:
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**{"model": PLAIN, "max_tokens": 4096, **kw})
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert e.value.body["error"]["message"].startswith(wording), e.value.body
        if "thinking" not in kw:  # count_tokens checks the same messages
            with pytest.raises(anthropic.BadRequestError):
                client.messages.count_tokens(model=PLAIN, messages=kw["messages"])


def test_max_tokens_zero_prewarms_the_prompt(client):
    """The API's cache pre-warming: no content, no output tokens, and the next request reads the prompt from cache."""
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "Remember this line of context. " * 20}]
    meta = {"user_id": uuid.uuid4().hex}  # the session's sticky key: the next request goes where the cache is
    warm = client.messages.create(model=PLAIN, max_tokens=0, messages=messages, metadata=meta)
    assert warm.content == [] and warm.stop_reason == "max_tokens" and warm.usage.output_tokens == 0
    assert warm.usage.input_tokens + warm.usage.cache_read_input_tokens > 100
    m = client.messages.create(model=PLAIN, max_tokens=5, messages=messages, metadata=meta,
                               extra_body=forced("Noted."))
    assert m.usage.cache_read_input_tokens > 0 and [b.text for b in m.content] == ["Noted."]


def test_omitted_thinking_is_sent_back_and_replays_the_reasoning(client):
    """`display: "omitted"`: the block has no text; sent back, it counts as the reasoning it sealed (qwen3 keeps the
    reasoning of the assistant turns after the last user query, so a tool loop's thinking is in the prompt)."""
    script = "<think>The listing will show the entry point.</think>" + call("Bash", {"command": "ls"})
    shown, omitted = (client.messages.create(model=THINK, max_tokens=200, messages=USER, tools=[BASH],
                                             thinking={"type": "adaptive", **display}, extra_body=forced(script))
                      for display in ({}, {"display": "omitted"}))
    assert shown.content[0].thinking == "The listing will show the entry point."
    assert omitted.content[0].thinking == "" and omitted.content[0].signature.startswith("sa2.")

    use = omitted.content[-1].model_dump(exclude_none=True)  # one tool id for every count: ids are tokens too
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "main.py"}]}
    sealed = [omitted.content[0].model_dump(exclude_none=True), use]

    def counted(content):
        return client.messages.count_tokens(model=THINK, tools=[BASH], thinking={"type": "adaptive"}, messages=[
            *USER, {"role": "assistant", "content": content}, result]).input_tokens

    assert counted(sealed) == counted([shown.content[0].model_dump(exclude_none=True), use]) > counted([use])
    m = client.messages.create(model=THINK, max_tokens=20, tools=[BASH], thinking={"type": "adaptive",
                               "display": "omitted"}, extra_body=forced("<think>Done.</think>Found it."),
                               messages=[*USER, {"role": "assistant", "content": sealed}, result])
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == ""


def test_a_search_result_reaches_the_prompt(client):
    sr = {"type": "search_result", "source": "https://example.com/paris", "title": "Paris weather",
          "content": [{"type": "text", "text": "Sunny and 21 degrees in Paris today."}]}
    question = {"type": "text", "text": "What is the weather?"}
    bare = client.messages.count_tokens(model=PLAIN, messages=[{"role": "user", "content": [question]}])
    with_sr = [{"role": "user", "content": [sr, question]}]
    counted = client.messages.count_tokens(model=PLAIN, messages=with_sr)
    assert counted.input_tokens >= bare.input_tokens + 12  # title, source and text all count
    m = client.messages.create(model=PLAIN, max_tokens=20, messages=with_sr, extra_body=forced("Sunny."))
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted.input_tokens


def test_a_final_assistant_message_is_continued(client, serve_url):
    prefill = "The best answer is ("
    messages = [{"role": "user", "content": "Greek name for the Sun? (A) Sol (B) Helios"},
                {"role": "assistant", "content": prefill}]
    m = client.messages.create(model=PLAIN, max_tokens=20, messages=messages, extra_body=forced("B) Helios"))
    assert [b.text for b in m.content] == ["B) Helios"]  # only the continuation, as the API answers
    with client.messages.stream(model=PLAIN, max_tokens=20, messages=messages, extra_body=forced("B) Helios")) as s:
        assert "".join(s.text_stream) == "B) Helios"
    # The engine saw the history then the prefill text, with no end of turn and no new generation prompt:
    # exactly the prompt vLLM's continue_final_message renders.
    tok = httpx.post(f"{serve_url}/v1/tokenize", json={"model": PLAIN, "messages": messages,
                                                       "continue_final_message": True}, timeout=60).json()
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == tok["count"]
    assert client.messages.count_tokens(model=PLAIN, messages=messages).input_tokens == tok["count"]
    new_turn = httpx.post(f"{serve_url}/v1/tokenize", json={"model": PLAIN, "messages": messages},
                          timeout=60).json()
    assert new_turn["count"] > tok["count"]
