"""The load generator reads the server's real wire format: SSE framing, and the Anthropic fold, checked against
the service's own encoder and fold (so the load test's tool loop sends back exactly what a real client would)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import httpx

from serve_app.conversation import Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, Usage
from serve_app.ingress.anthropic import encode as anthropic_encode

ROOT = Path(__file__).resolve().parents[2]
# agent_wire, not the locustfile: importing locust would monkey-patch this whole test process with gevent.
_spec = importlib.util.spec_from_file_location("agent_wire", ROOT / "load" / "agent_wire.py")
wire = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wire)


def _anthropic_stream():
    enc = anthropic_encode.MessageEncoder("m", "msg_1", thinking=True, secret=b"k")
    events = []
    for ev in [Usage(prompt_tokens=100, completion_tokens=0, cached_tokens=60, estimated=True),
               ReasoningDelta(text="Let me "), ReasoningDelta(text="look."), TextDelta(text="Running it.\n"),
               ToolCallStart(index=0, id="call_1", name="Bash"), ToolCallArgsDelta(index=0, arguments='{"command": '),
               ToolCallArgsDelta(index=0, arguments='"ls -la"}'), ToolCallEnd(index=0),
               Usage(prompt_tokens=100, completion_tokens=20, cached_tokens=64), Finish(reason="tool_calls")]:
        events.extend(enc.event(ev))
    return events


def test_iter_sse_parses_frames_and_skips_comments():
    raw = b": keep-alive\n\nevent: ping\ndata: {\"type\": \"ping\"}\n\ndata: {\"a\":\ndata: 1}\n\ndata: [DONE]\n\n"
    got = list(wire.iter_sse(httpx.Response(200, content=raw)))
    assert got == [("ping", '{"type": "ping"}'), (None, '{"a":\n1}'), (None, "[DONE]")]


def test_aiter_sse_gives_the_same_events_from_an_async_stream():
    import asyncio

    raw = b": keep-alive\n\nevent: ping\ndata: {\"type\": \"ping\"}\n\ndata: {\"a\":\ndata: 1}\n\ndata: [DONE]"

    async def run():
        return [e async for e in wire.aiter_sse(httpx.Response(200, content=raw))]

    assert asyncio.run(run()) == [("ping", '{"type": "ping"}'), (None, '{"a":\n1}'), (None, "[DONE]")]


def test_anthropic_fold_matches_the_service_fold():
    events = _anthropic_stream()
    frames = anthropic_encode.to_frames(events)
    parsed = [(name, json.loads(data))
              for name, data in wire.iter_sse(httpx.Response(200, content=frames))]
    blocks, stop, usage = wire.fold_anthropic(parsed)
    expected = anthropic_encode.fold(events)
    assert blocks == expected["content"]
    assert stop == expected["stop_reason"] == "tool_use"
    assert usage["cache_read_input_tokens"] + usage["input_tokens"] == 100
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[2]["input"] == {"command": "ls -la"} and blocks[0]["signature"]


def test_billing_line_is_stable_per_session_and_differs_across_sessions():
    a1, a2, b = wire.billing_line("a"), wire.billing_line("a"), wire.billing_line("b")
    assert a1 == a2 != b and a1.startswith("x-anthropic-billing-header: cc_version=")


def test_stable_system_prompt_is_identical_across_processes():
    assert wire.stable_text(300, "s") == wire.stable_text(300, "s")
    assert len(wire.stable_text(300, "s").split()) >= 300
