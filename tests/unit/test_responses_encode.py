"""The Responses encoder, driven by synthetic event lists; the real `openai` SDK parses the bytes it produces
(over an httpx MockTransport), so the SDK's own consistency checks (item identities, lifecycle ids, unfinished
items) run on our stream."""

from __future__ import annotations

import json
import typing

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseError

from serve_app.conversation import (
    Finish,
    drop_abandoned_calls,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from serve_app.errors import ErrorKind
from serve_app.ingress.responses.encode import (
    CODEX_CODES,
    ERROR_CODES,
    ResponsesEncoder,
    _JsonStringValue,
    error_code,
    fold,
)

ECHO = {"instructions": None, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "metadata": {},
        "store": False, "temperature": 1.0, "top_p": 1.0, "text": {"format": {"type": "text"}}}


def encode(events, **kw) -> bytes:
    enc = ResponsesEncoder(response_id="resp_test", model="m", echo=ECHO, **kw)
    out = b"".join(enc.start())
    for ev in events:
        out += b"".join(enc.event(ev))
    return out


def sdk_client(body: bytes) -> openai.OpenAI:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return openai.OpenAI(api_key="x", base_url="http://test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def sdk_stream(body: bytes):
    """(events, final response) as the SDK's `responses.stream` helper sees them."""
    with sdk_client(body).responses.stream(model="m", input="hi") as stream:
        events = list(stream)
        final = stream.get_final_response()
    return events, final


def raw_events(body: bytes) -> list[dict]:
    out = []
    for block in body.decode().split("\n\n"):
        data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
        if data:
            out.append(json.loads(data[0]))
    return out


def usage(n=20, c=9, cached=16, r=0):
    return [Usage(n, 0, cached_tokens=cached, estimated=True), Usage(n, c, cached_tokens=cached, reasoning_tokens=r)]


def test_text_only_sequence_and_final_response():
    events, final = sdk_stream(encode([usage()[0], TextDelta("Hel"), TextDelta("lo"), usage()[1], Finish("stop")]))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.id == "resp_test" and final.status == "completed"
    assert final.output_text == "Hello"
    u = final.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (20, 9, 29)
    assert u.input_tokens_details.cached_tokens == 16 and u.output_tokens_details.reasoning_tokens == 0


def test_reasoning_then_call_then_text_keeps_order_and_ids():
    evs = [
        usage()[0],
        ReasoningDelta("think "), ReasoningDelta("more"),
        ToolCallStart(0, "call_1", "shell"), ToolCallArgsDelta(0, '{"cmd": '), ToolCallArgsDelta(0, '"ls"}'),
        ToolCallEnd(0),
        ReasoningDelta("again"),
        TextDelta("done"),
        Usage(20, 9, cached_tokens=16, reasoning_tokens=4), Finish("tool_calls"),
    ]
    body = encode(evs, summaries=True)
    events, final = sdk_stream(body)
    assert [o.type for o in final.output] == ["reasoning", "function_call", "reasoning", "message"]
    rs, fc = final.output[0], final.output[1]
    assert rs.summary[0].text == "think more" and rs.content is None  # the summary channel only, never both
    assert fc.arguments == '{"cmd": "ls"}' and fc.call_id == "call_1" and fc.name == "shell"
    assert final.usage.output_tokens_details.reasoning_tokens == 4
    # One id per item, identical in every event that names it and in response.completed.
    raw = raw_events(body)
    added = {e["output_index"]: e["item"]["id"] for e in raw if e["type"] == "response.output_item.added"}
    done = {e["output_index"]: e["item"]["id"] for e in raw if e["type"] == "response.output_item.done"}
    assert added == done == {i: o.id for i, o in enumerate(final.output)}
    for e in raw:
        if "item_id" in e:
            assert e["item_id"] == added[e["output_index"]], e
    types = [e["type"] for e in raw]
    for t in ("response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
              "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
              "response.function_call_arguments.delta", "response.function_call_arguments.done"):
        assert t in types
    assert not [t for t in types if t.startswith("response.reasoning_text")]
    fdone = next(e for e in raw if e["type"] == "response.function_call_arguments.done")
    assert fdone["arguments"] == '{"cmd": "ls"}'
    assert types[-1] == "response.completed" and types.count("response.completed") == 1


def test_no_summary_events_unless_requested():
    raw = raw_events(encode([ReasoningDelta("x"), TextDelta("y"), *usage(), Finish("stop")]))
    assert not [e for e in raw if "summary" in e["type"]]
    rs = next(e["item"] for e in raw if e["type"] == "response.output_item.done")
    assert rs["summary"] == [] and rs["content"] == [{"type": "reasoning_text", "text": "x"}]
    assert "status" not in rs  # a reasoning item that finished carries no status, as the API's


REASONING_DELTAS = ("response.reasoning_text.delta", "response.reasoning_summary_text.delta")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(min_size=1), min_size=1, max_size=6), st.booleans(), st.booleans(),
       st.sampled_from(["stop", "length", "context_window"]))
def test_each_reasoning_token_goes_out_once_per_channel(pieces, summaries, sealed, reason):
    """Streamed, the reasoning's text leaves exactly once (as summary when asked for one, else as raw text); the
    finished item and the folded response carry it once on that channel, and sealed once more when asked."""
    thought = "".join(pieces)
    evs = [*[ReasoningDelta(p) for p in pieces], TextDelta("a"), *usage(), Finish(reason)]
    seal = (lambda t: f"S({t})") if sealed else None
    raw = raw_events(encode(evs, summaries=summaries, seal=seal))
    deltas = [e for e in raw if e["type"] in REASONING_DELTAS]
    assert "".join(e["delta"] for e in deltas) == thought
    assert {e["type"] for e in deltas} == {REASONING_DELTAS[summaries]}
    done = next(e["item"] for e in raw if e["type"] == "response.output_item.done")
    folded = fold(ResponsesEncoder(response_id="r", model="m", echo=ECHO, summaries=summaries, seal=seal), evs)
    for item in (done, raw[-1]["response"]["output"][0], folded["output"][0]):
        texts = [p["text"] for p in item["summary"] + (item.get("content") or [])]
        assert texts == [thought]
        assert item.get("encrypted_content") == (f"S({thought})" if sealed else None)


def test_parallel_calls_become_separate_items():
    evs = [
        ToolCallStart(0, "call_a", "read"), ToolCallArgsDelta(0, '{"p": "a"}'), ToolCallEnd(0),
        ToolCallStart(1, "call_b", "read"), ToolCallArgsDelta(1, '{"p": "b"}'), ToolCallEnd(1),
        *usage(), Finish("tool_calls"),
    ]
    _, final = sdk_stream(encode(evs))
    assert [(o.type, o.call_id, o.arguments) for o in final.output] == [
        ("function_call", "call_a", '{"p": "a"}'), ("function_call", "call_b", '{"p": "b"}')]
    assert len({o.id for o in final.output}) == 2


def test_custom_tool_call_streams_raw_input():
    patch = '*** Begin Patch\n*** Add File: a.txt\n+say "hi" \\ \u00e9\U0001f600\n*** End Patch'
    args = json.dumps({"input": patch})
    frags = [args[i:i + 3] for i in range(0, len(args), 3)]  # splits escapes and \u sequences
    evs = [ToolCallStart(0, "call_p", "apply_patch"), *[ToolCallArgsDelta(0, f) for f in frags], ToolCallEnd(0),
           *usage(), Finish("tool_calls")]
    body = encode(evs, custom_tools={"apply_patch"})
    events, final = sdk_stream(body)
    item = final.output[0]
    assert item.type == "custom_tool_call" and item.input == patch and item.call_id == "call_p"
    deltas = "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta")
    assert deltas == patch
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    assert len(done) == 1 and done[0].input == patch
    assert not [e for e in events if e.type.startswith("response.function_call")]


@settings(max_examples=200, deadline=None)
@given(st.text(), st.lists(st.integers(min_value=0, max_value=200), max_size=8))
def test_json_string_value_split_invariance(value, cuts):
    args = json.dumps({"input": value}, ensure_ascii=bool(len(value) % 2))
    points = sorted({c % (len(args) + 1) for c in cuts})
    pieces = [args[a:b] for a, b in zip([0, *points], [*points, len(args)])]
    dec = _JsonStringValue()
    assert "".join(dec.push(p) for p in pieces) == value


SDK_ERROR_CODES = set(typing.get_args(ResponseError.model_fields["code"].annotation))


@pytest.mark.parametrize("kind", typing.get_args(ErrorKind))
def test_every_error_kind_maps_into_the_sdks_error_code_enum_or_a_code_codex_reads(kind):
    assert error_code(kind) in SDK_ERROR_CODES | CODEX_CODES
    assert set(ERROR_CODES.values()) <= SDK_ERROR_CODES | CODEX_CODES
    # the exceptions are only what the enum lacks (a code the SDK gains leaves the list)
    assert not CODEX_CODES & SDK_ERROR_CODES


def test_engine_error_becomes_response_failed_with_code():
    body = encode([TextDelta("partial"), Finish("error", error="queue full", error_kind="overloaded")])
    raw = raw_events(body)
    assert raw[-1]["type"] == "response.failed"
    err = raw[-1]["response"]["error"]
    assert err == {"code": "server_is_overloaded", "message": "queue full"}  # Codex's ServerOverloaded
    assert raw[-1]["response"]["status"] == "failed"
    # the partial message was still closed as an item before the failure, as one the failure cut off
    done = [e["item"] for e in raw if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [("message", "incomplete")]
    events = list(sdk_client(body).responses.create(model="m", input="x", stream=True))
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "server_is_overloaded"


def test_engine_error_codes_in_the_sdks_enum_validate_strictly():
    body = encode([TextDelta("partial"), Finish("error", error="engine died", error_kind="api_error")])
    failed = raw_events(body)[-1]["response"]
    assert failed["error"] == {"code": "server_error", "message": "engine died"}
    Response.model_validate(failed)  # strictly: the code is a member of the SDK's enum


@pytest.mark.parametrize("reason", ["length", "context_window"])
def test_a_token_limit_leaves_the_cut_item_and_the_response_incomplete(reason):
    """The client's max_output_tokens and a context that filled end alike, as the API reports both: status
    incomplete, reason max_output_tokens, and the item the limit cut off says incomplete; items finished before
    it stay completed. Streamed and folded agree."""
    evs = [ToolCallStart(0, "c1", "f"), ToolCallArgsDelta(0, "{}"), ToolCallEnd(0), TextDelta("cut"),
           *usage(), Finish(reason)]
    body = encode(evs)
    raw = raw_events(body)
    assert raw[-1]["type"] == "response.incomplete"
    streamed = raw[-1]["response"]
    assert streamed["status"] == "incomplete" and streamed["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [(i["type"], i["status"]) for i in streamed["output"]] == [("function_call", "completed"),
                                                                     ("message", "incomplete")]
    done = [e["item"]["status"] for e in raw if e["type"] == "response.output_item.done"]
    assert done == ["completed", "incomplete"]
    Response.model_validate(streamed)
    # (the SDK's `stream` helper only returns a final response for response.completed, as against the API)
    events = list(sdk_client(body).responses.create(model="m", input="x", stream=True))
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert final.output[1].status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    folded = fold(ResponsesEncoder(response_id="resp_x", model="m", echo=ECHO, created_at=1), evs)
    assert [(i["type"], i["status"]) for i in folded["output"]] == [("function_call", "completed"),
                                                                   ("message", "incomplete")]
    assert folded["status"] == "incomplete" and folded["incomplete_details"] == streamed["incomplete_details"]


def test_reasoning_cut_off_by_the_limit_is_incomplete_and_a_cut_off_call_is_never_sent():
    raw = raw_events(encode([ReasoningDelta("hmm"), *usage(), Finish("length")]))
    assert raw[-1]["response"]["output"][0]["status"] == "incomplete"
    # The parser gives back the raw text of a call the end cut off; the call itself was never an item a client
    # could run (clients run calls from output_item.done): the message holds what the model wrote.
    raw = raw_events(encode([TextDelta("Let me look."), ToolCallStart(0, "c", "f"), ToolCallArgsDelta(0, '{"a": '),
                             TextDelta('<tool_call>{"name": "f", "arguments": {"a": '), *usage(),
                             Finish("context_window")]))
    assert not any(e["type"].startswith("response.function_call") or e.get("item", {}).get("type") == "function_call"
                   for e in raw)
    out = raw[-1]["response"]["output"]
    assert [(i["type"], i["status"]) for i in out] == [("message", "incomplete")]
    assert out[0]["content"][0]["text"] == 'Let me look.<tool_call>{"name": "f", "arguments": {"a": '


def test_a_call_is_sent_whole_when_it_ends_and_one_abandoned_mid_stream_never():
    evs = [TextDelta("a"), ToolCallStart(0, "c0", "f"), ToolCallArgsDelta(0, '{"x": 1'), TextDelta("<bad call>"),
           ToolCallStart(1, "c1", "f"), ToolCallArgsDelta(1, '{"x": '), ToolCallArgsDelta(1, "2}"), ToolCallEnd(1),
           *usage(), Finish("tool_calls")]
    enc = ResponsesEncoder(response_id="resp_x", model="m", echo=ECHO, created_at=1)
    per_event = [raw_events(b"".join(enc.event(ev))) for ev in evs]
    assert per_event[1] == per_event[2] == per_event[5] == per_event[6] == []  # held while they stream
    assert [e["type"] for e in per_event[7]] == [  # the message before it ends, then the whole call
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    assert per_event[7][4]["delta"] == '{"x": 2}'
    final = per_event[-1][-1]["response"]
    assert [(i["type"], i.get("arguments")) for i in final["output"]] == [("message", None), ("function_call", '{"x": 2}')]
    assert final["output"][0]["content"][0]["text"] == "a<bad call>"
    folded = fold(ResponsesEncoder(response_id="resp_x", model="m", echo=ECHO, created_at=1),
                  drop_abandoned_calls(list(evs)))
    assert [{k: v for k, v in i.items() if k != "id"} for i in folded["output"]] == \
        [{k: v for k, v in i.items() if k != "id"} for i in final["output"]]


def test_fold_equals_streamed_final_response():
    evs = [ReasoningDelta("r"), TextDelta("a"), ToolCallStart(0, "c", "f"), ToolCallArgsDelta(0, "{}"),
           ToolCallEnd(0), *usage(), Finish("tool_calls")]
    enc = ResponsesEncoder(response_id="resp_x", model="m", echo=ECHO, created_at=1)
    folded = fold(enc, list(evs))
    streamed = raw_events(encode(evs))[-1]["response"]

    def strip(resp):
        return [{k: v for k, v in item.items() if k != "id"} for item in resp["output"]]

    assert strip(folded) == strip(streamed)
    assert folded["usage"] == streamed["usage"] and folded["status"] == streamed["status"] == "completed"


def test_seal_is_applied_to_reasoning_items():
    raw = raw_events(encode([ReasoningDelta("secret thought"), *usage(), Finish("stop")], seal=lambda t: f"S({t})"))
    item = next(e["item"] for e in raw if e["type"] == "response.output_item.done")
    assert item["encrypted_content"] == "S(secret thought)"


def test_echoed_parameters_in_created_and_completed():
    raw = raw_events(encode([TextDelta("x"), *usage(), Finish("stop")]))
    for e in (raw[0], raw[-1]):
        assert e["response"]["id"] == "resp_test"
        for k, v in ECHO.items():
            assert e["response"][k] == v


@pytest.mark.parametrize("args,expected", [('{"input": "x"}', "x"), ('{"patch": "y"}', "y"), ("not json", "not json")])
def test_custom_input_from_arguments(args, expected):
    from serve_app.ingress.responses.encode import custom_input_from_arguments

    assert custom_input_from_arguments(args) == expected
