"""Events → Anthropic stream: block lifecycle, thinking gating and signatures, stop reasons, usage, folding."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.conversation import (
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from serve_app.errors import ServiceError
from serve_app.ingress.anthropic import signatures
from serve_app.ingress.anthropic.encode import MessageEncoder, fold, to_frames

SECRET = b"k" * 32


def run(events, thinking=True):
    enc = MessageEncoder("m", "msg_1", thinking=thinking, secret=SECRET, prompt_tokens=100)
    out = []
    for ev in events:
        out.extend(enc.event(ev))
    return out


def check_lifecycle(stream) -> None:
    """What the SDK accumulator and Claude Code's stream loop insist on (harness-contracts A6)."""
    names = [n for n, _ in stream]
    assert names[0] == "message_start" and names.count("message_start") == 1
    assert names[-1] == "message_stop" and names.count("message_stop") == 1
    assert names[-2] == "message_delta"
    open_idx, kind, next_idx, sigs = None, None, 0, 0
    for name, data in stream:
        assert data["type"] == name
        if name == "content_block_start":
            assert open_idx is None, "a block opened while another is open"
            assert data["index"] == next_idx
            open_idx, kind, next_idx, sigs = data["index"], data["content_block"]["type"], next_idx + 1, 0
            if kind == "tool_use":
                cb = data["content_block"]
                assert cb["id"].startswith("toolu_") and cb["name"] and cb["input"] == {}
        elif name == "content_block_delta":
            assert data["index"] == open_idx, "delta to a block that is not open"
            d = data["delta"]
            allowed = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"},
                       "tool_use": {"input_json_delta"}}[kind]
            assert d["type"] in allowed
            if d["type"] == "signature_delta":
                sigs += 1
            else:
                assert sigs == 0, "thinking after the signature"
            if d["type"] == "text_delta":
                assert d["text"]
        elif name == "content_block_stop":
            assert data["index"] == open_idx
            if kind == "thinking":
                assert sigs == 1
            open_idx = None
    assert open_idx is None


def u0(prompt=100, cached=40):
    return Usage(prompt, 0, cached_tokens=cached, estimated=True)


def tail(reason="stop", prompt=100, cached=60, completion=9, **kw):
    return [Usage(prompt, completion, cached_tokens=cached), Finish(reason, **kw)]


def test_thinking_text_tool_sequence_and_usage():
    s = run([u0(), ReasoningDelta("hmm "), ReasoningDelta("ok"), TextDelta("I'll run it."),
             ToolCallStart(0, "call_ab12", "Bash"), ToolCallArgsDelta(0, '{"command": "ec'),
             ToolCallArgsDelta(0, 'ho hi"}'), ToolCallEnd(0), *tail("tool_calls")])
    check_lifecycle(s)
    start = s[0][1]["message"]
    assert start["usage"]["input_tokens"] == 60 and start["usage"]["cache_read_input_tokens"] == 40
    assert start["content"] == [] and start["stop_reason"] is None
    blocks = [d["content_block"]["type"] for n, d in s if n == "content_block_start"]
    assert blocks == ["thinking", "text", "tool_use"]
    delta = s[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 9
    assert delta["usage"]["input_tokens"] == 40 and delta["usage"]["cache_read_input_tokens"] == 60
    msg = fold(s)
    assert msg["content"][0]["thinking"] == "hmm ok"
    assert signatures.verify(SECRET, "hmm ok", msg["content"][0]["signature"])
    assert msg["content"][1] == {"type": "text", "text": "I'll run it."}
    assert msg["content"][2] == {"type": "tool_use", "id": "toolu_ab12", "name": "Bash", "input": {"command": "echo hi"}}
    assert msg["stop_reason"] == "tool_use"
    assert msg["usage"]["output_tokens"] == 9


def test_thinking_off_drops_reasoning_never_text():
    s = run([u0(), ReasoningDelta("secret thoughts"), TextDelta("Hello"), ReasoningDelta("more"), TextDelta(" world"),
             *tail()], thinking=False)
    check_lifecycle(s)
    msg = fold(s)
    assert msg["content"] == [{"type": "text", "text": "Hello world"}]
    assert "secret" not in to_frames(s).decode()


def test_interleaved_think_tool_think_tool_opens_new_blocks():
    s = run([u0(), ReasoningDelta("a"), ToolCallStart(0, "call_1", "Read"), ToolCallArgsDelta(0, '{"p": 1}'),
             ToolCallEnd(0), ReasoningDelta("b"), ToolCallStart(1, "call_2", "Read"), ToolCallArgsDelta(1, '{"p": 2}'),
             ToolCallEnd(1), *tail("tool_calls")])
    check_lifecycle(s)
    msg = fold(s)
    assert [b["type"] for b in msg["content"]] == ["thinking", "tool_use", "thinking", "tool_use"]
    assert [b.get("input") for b in msg["content"] if b["type"] == "tool_use"] == [{"p": 1}, {"p": 2}]
    assert msg["content"][0]["signature"] != msg["content"][2]["signature"]
    assert signatures.verify(SECRET, "b", msg["content"][2]["signature"])


def test_parallel_tool_calls_each_get_an_index():
    s = run([u0(), ToolCallStart(0, "call_1", "A"), ToolCallArgsDelta(0, "{}"), ToolCallEnd(0),
             ToolCallStart(1, "call_2", "B"), ToolCallArgsDelta(1, '{"x": [1]}'), ToolCallEnd(1), *tail("tool_calls")])
    check_lifecycle(s)
    msg = fold(s)
    assert [(b["name"], b["input"]) for b in msg["content"]] == [("A", {}), ("B", {"x": [1]})]
    assert len({b["id"] for b in msg["content"]}) == 2


def test_tool_without_end_is_closed_at_finish_and_empty_args_are_an_empty_object():
    s = run([u0(), ToolCallStart(0, "call_1", "Noop"), *tail("tool_calls")])
    check_lifecycle(s)
    assert fold(s)["content"][0]["input"] == {}


def held(events, eager=frozenset(), thinking=True):
    enc = MessageEncoder("m", "msg_1", thinking=thinking, secret=SECRET, prompt_tokens=100, eager_tools=eager)
    return [[se for se in enc.event(ev)] for ev in events]


def test_a_call_of_a_tool_without_eager_streaming_goes_out_whole_when_it_ends():
    """As the API validates such a tool's input before streaming it: nothing of the call before its end, then the
    block with its whole input at once (the call is still dispatched the moment it is complete)."""
    evs = [u0(), TextDelta("Running."), ToolCallStart(0, "call_1", "Bash"), ToolCallArgsDelta(0, '{"command": '),
           ToolCallArgsDelta(0, '"ls"}'), ToolCallEnd(0), ToolCallStart(1, "call_2", "Write"),
           ToolCallArgsDelta(1, '{"path": "a"}'), ToolCallEnd(1), *tail("tool_calls")]
    per_event = held(evs, eager=frozenset({"Write"}))
    assert per_event[2] == per_event[3] == per_event[4] == []  # Bash held: not even the open text block closes
    names = [n for n, _ in per_event[5]]
    assert names == ["content_block_stop", "content_block_start", "content_block_delta", "content_block_stop"]
    assert per_event[5][2][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"command": "ls"}'}
    assert [n for n, _ in per_event[6]] == ["content_block_start"]  # Write streams as generated
    assert [n for n, _ in per_event[7]] == ["content_block_delta"]
    s = [se for out in per_event for se in out]
    check_lifecycle(s)
    assert fold(s) == fold(run(evs))  # the same message as streaming every call as generated


@pytest.mark.parametrize("abandoned", [
    # cut off by the end of the stream: the parser gives the raw markup back as text
    [ToolCallStart(0, "call_1", "Bash"), ToolCallArgsDelta(0, '{"command": "rm -rf /tmp/bu'),
     TextDelta('<tool_call>{"name": "Bash", "arguments": {"command": "rm -rf /tmp/bu')],
    # malformed mid-stream, then more text and a good call
    [ToolCallStart(0, "call_1", "Bash"), ToolCallArgsDelta(0, '{"command": "ls"'), TextDelta("<tool_call>{oops}"),
     TextDelta(" then"), ToolCallStart(1, "call_2", "Bash"), ToolCallArgsDelta(1, '{"command": "pwd"}'),
     ToolCallEnd(1)],
    # abandoned with nothing after it
    [ToolCallStart(0, "call_1", "Bash"), ToolCallArgsDelta(0, '{"comm')],
])
def test_an_abandoned_call_of_a_held_tool_is_never_sent_so_the_stream_folds_to_the_complete_answer(abandoned):
    from serve_app.conversation import drop_abandoned_calls

    evs = [u0(), TextDelta("I will."), *abandoned, *tail("length")]
    streamed = fold([se for out in held(evs) for se in out])
    complete = fold([se for out in held(drop_abandoned_calls(evs)) for se in out])
    assert streamed == complete
    assert all(b["input"] == {"command": "pwd"} for b in streamed["content"] if b["type"] == "tool_use")
    eager = fold(run(evs))  # streamed as generated (the beta, or the tool's flag): the half call went out
    assert any(b["type"] == "tool_use" and b["input"] != {"command": "pwd"} for b in eager["content"])


def test_no_empty_or_whitespace_only_text_blocks():
    s = run([u0(), TextDelta(""), ReasoningDelta("x"), TextDelta("\n\n"), ToolCallStart(0, "call_1", "A"),
             ToolCallEnd(0), TextDelta("  "), *tail("tool_calls")])
    check_lifecycle(s)
    assert [b["type"] for b in fold(s)["content"]] == ["thinking", "tool_use"]


def test_leading_whitespace_kept_once_text_is_real():
    s = run([u0(), TextDelta("\n"), TextDelta("  hi"), TextDelta(" "), *tail()])
    assert fold(s)["content"] == [{"type": "text", "text": "\n  hi "}]


@pytest.mark.parametrize(
    "finish,reason,seq",
    [
        (Finish("stop"), "end_turn", None),
        (Finish("length"), "max_tokens", None),
        (Finish("tool_calls"), "tool_use", None),
        (Finish("stop_sequence", stop_sequence="END"), "stop_sequence", "END"),
    ],
)
def test_stop_reasons(finish, reason, seq):
    s = run([u0(), TextDelta("x"), Usage(100, 1), finish])
    check_lifecycle(s)
    assert s[-2][1]["delta"] == {"stop_reason": reason, "stop_sequence": seq}


def test_error_after_start_is_an_error_event_and_the_stream_ends():
    enc = MessageEncoder("m", "msg_1", thinking=False, secret=SECRET)
    out = enc.event(u0()) + enc.event(TextDelta("part"))
    out += enc.event(Finish("error", error="engine died", error_kind="overloaded"))
    assert out[-1] == ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "engine died"}})
    assert enc.done and enc.event(TextDelta("more")) == []
    frames = to_frames(out).decode()
    assert frames.endswith('event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"engine died"}}\n\n')
    with pytest.raises(ServiceError) as e:
        fold(out)
    assert e.value.kind == "overloaded"  # the Anthropic envelope's 529 (test_anthropic_routes)


def test_ping_before_first_usage_starts_the_message_first():
    enc = MessageEncoder("m", "msg_1", thinking=False, secret=SECRET, prompt_tokens=77)
    out = enc.ping()
    assert [n for n, _ in out] == ["message_start", "ping"]
    assert out[0][1]["message"]["usage"]["input_tokens"] == 77
    assert enc.event(u0()) == []  # never a second message_start
    assert enc.ping() == [("ping", {"type": "ping"})]


def test_message_start_is_followed_by_a_ping_at_once():
    enc = MessageEncoder("m", "msg_1", thinking=False, secret=SECRET, prompt_tokens=77)
    assert [n for n, _ in enc.event(u0())] == ["message_start", "ping"]
    assert [n for n, _ in enc.event(TextDelta("hi"))] == ["content_block_start", "content_block_delta"]


def test_every_frame_has_an_event_line():
    s = run([u0(), ReasoningDelta("r"), TextDelta("t"), *tail()])
    raw = to_frames(s).decode()
    frames = [f for f in raw.split("\n\n") if f]
    assert len(frames) == len(s)
    for f, (name, data) in zip(frames, s):
        ev, payload = f.split("\n")
        assert ev == f"event: {name}"
        assert json.loads(payload[len("data: "):]) == data


_events = st.lists(
    st.one_of(
        st.builds(ReasoningDelta, st.text(max_size=5)),
        st.builds(TextDelta, st.text(alphabet=" \nab", max_size=5)),
        st.just("call"),
    ),
    max_size=25,
)


@settings(max_examples=200, deadline=None)
@given(_events, st.booleans())
def test_any_event_order_gives_a_well_formed_stream(items, thinking):
    evs, n = [u0()], 0
    for it in items:
        if it == "call":
            evs += [ToolCallStart(n, f"call_{n}", "T"), ToolCallArgsDelta(n, '{"i": '), ToolCallArgsDelta(n, f"{n}}}"),
                    ToolCallEnd(n)]
            n += 1
        else:
            evs.append(it)
    s = run(evs + tail("tool_calls" if n else "stop"), thinking=thinking)
    check_lifecycle(s)
    msg = fold(s)
    assert [b["input"]["i"] for b in msg["content"] if b["type"] == "tool_use"] == list(range(n))
    # Expected text blocks: one per run of text between other content, whitespace-only runs dropped.
    runs, cur = [], []
    for e in evs:
        if isinstance(e, TextDelta):
            cur.append(e.text)
        elif isinstance(e, ToolCallStart) or (thinking and isinstance(e, ReasoningDelta) and e.text):
            runs.append("".join(cur))
            cur = []
    runs.append("".join(cur))
    assert [b["text"] for b in msg["content"] if b["type"] == "text"] == [r for r in runs if r.strip()]
    if not thinking:
        assert all(b["type"] != "thinking" for b in msg["content"])
    else:
        for b in msg["content"]:
            if b["type"] == "thinking":
                assert signatures.verify(SECRET, b["thinking"], b["signature"])


@given(st.text(), st.sampled_from(["text_delta", "thinking_delta", "input_json_delta"]), st.integers(0, 500))
def test_fast_delta_frames_equal_the_generic_framing(text, kind, index):
    from serve_app.ingress import sse

    field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[kind]
    data = {"type": "content_block_delta", "index": index, "delta": {"type": kind, field: text}}
    assert to_frames([("content_block_delta", data)]) == sse.frame(data, "content_block_delta")
