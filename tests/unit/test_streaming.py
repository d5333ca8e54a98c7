"""The one generation driver (serve_app/ingress/streaming.py), seen through the Chat route: the non-streaming body
is the stream folded, refusals before output keep their HTTP status, a stream cut short ends in-protocol."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from serve_app.conversation import Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, Usage
from serve_app.errors import Overloaded
from serve_app.ingress.context import IngressContext
from serve_app.ingress.server import create_app
from serve_app.service import PreparedRequest
from serve_app.settings import AppSettings

SETTINGS = AppSettings.model_validate({"models": [{"id": "m1"}]})

SCRIPTS = {
    "think_call": [Usage(7, 0, estimated=True), ReasoningDelta("let me "), ReasoningDelta("look"), TextDelta("ok "),
                   ToolCallStart(0, "call_1", "ls"), ToolCallArgsDelta(0, '{"path":'), ToolCallArgsDelta(0, ' "."}'),
                   ToolCallEnd(0), Usage(7, 9, cached_tokens=3, reasoning_tokens=2), Finish("tool_calls")],
    "refused": [Finish("error", error="the engine queue is full", error_kind="overloaded")],
    "cut_short": [Usage(7, 0, estimated=True), TextDelta("par")],
    "fails_late": [Usage(7, 0, estimated=True), TextDelta("par"), Finish("error", error="engine died",
                                                                         error_kind="api_error")],
}


class StubService:
    async def prepare(self, conv, opts, model_id, received=None, routed=None):
        if model_id == "busy":
            raise Overloaded(retry_after=2.5)
        model = SETTINGS.find_model(model_id)
        return PreparedRequest(request_id=uuid.uuid4().hex, model_id=model_id, model=model, conversation=conv,
                               options=opts, prompt_token_ids=[1] * 7, max_tokens=16)

    async def stream(self, prepared):
        for ev in SCRIPTS[prepared.conversation.messages[-1].parts[0].text]:
            yield ev

    async def complete(self, prepared):
        return [ev async for ev in self.stream(prepared)]


def client() -> httpx.AsyncClient:
    app = create_app(IngressContext(settings=SETTINGS, service=StubService(), secret=b"s"))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def body(script: str, **kw) -> dict:
    return {"model": "m1", "messages": [{"role": "user", "content": script}], **kw}


def data_frames(raw: str) -> list:
    out = []
    for block in raw.split("\n\n"):
        lines = [ln for ln in block.split("\n") if ln.startswith("data: ")]
        if lines:
            payload = lines[0][6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def fold(frames: list) -> tuple[dict, str | None, dict | None]:
    """What the openai SDK's stream accumulator builds: the message, the finish reason, the usage."""
    msg: dict = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = usage = None
    for f in frames:
        if f == "[DONE]":
            continue
        usage = f.get("usage") or usage
        for choice in f.get("choices", ()):
            d = choice["delta"]
            msg["content"] += d.get("content") or ""
            msg["reasoning_content"] += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls") or []:
                c = msg["tool_calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                c["id"] = tc.get("id") or c["id"]
                c["name"] = tc["function"].get("name") or c["name"]
                c["arguments"] += tc["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return msg, finish, usage


async def test_the_non_streaming_body_is_the_stream_folded():
    async with client() as c:
        whole = (await c.post("/v1/chat/completions", json=body("think_call"))).json()
        r = await c.post("/v1/chat/completions", json=body("think_call", stream=True,
                                                            stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = data_frames(r.text)
    assert frames[-1] == "[DONE]"
    msg, finish, usage = fold(frames)
    got = whole["choices"][0]["message"]
    assert got["content"] == msg["content"] == "ok "
    assert got["reasoning_content"] == msg["reasoning_content"] == "let me look"
    assert [(t["id"], t["function"]["name"], t["function"]["arguments"]) for t in got["tool_calls"]] == [
        (c["id"], c["name"], c["arguments"]) for _, c in sorted(msg["tool_calls"].items())] == [
        ("call_1", "ls", '{"path": "."}')]
    assert whole["choices"][0]["finish_reason"] == finish == "tool_calls"
    assert whole["usage"] == usage and usage["prompt_tokens_details"]["cached_tokens"] == 3
    assert whole["object"] == "chat.completion" and frames[0]["object"] == "chat.completion.chunk"


@pytest.mark.parametrize("stream", [False, True])
async def test_refusals_before_any_output_keep_their_http_status(stream):
    async with client() as c:
        r = await c.post("/v1/chat/completions", json=body("refused", stream=stream))
        # OpenAI's overload answer (Anthropic's 529 is not a status OpenAI clients know)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        assert r.json()["error"]["code"] == "server_is_overloaded" and r.headers["retry-after"] == "1"
        r = await c.post("/v1/chat/completions", json={**body("x", stream=stream), "model": "busy"})
        assert r.status_code == 503 and r.headers["retry-after"] == "3"  # 2.5 s, rounded up


@pytest.mark.parametrize("stream", [False, True])
async def test_overload_is_what_the_openai_sdk_knows_as_a_503(stream):
    app = create_app(IngressContext(settings=SETTINGS, service=StubService(), secret=b"s"))
    sdk = openai.AsyncOpenAI(api_key="x", base_url="http://t/v1", max_retries=0,
                             http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))
    with pytest.raises(openai.InternalServerError) as e:
        await sdk.chat.completions.create(model="busy", messages=[{"role": "user", "content": "x"}], stream=stream)
    assert e.value.status_code == 503 and e.value.code == "server_is_overloaded"
    assert e.value.response.headers["retry-after"] == "3"


async def test_failures_after_output_end_the_stream_in_protocol():
    async with client() as c:
        for script, message in (("fails_late", "engine died"),
                                ("cut_short", "the generation ended without finishing")):
            r = await c.post("/v1/chat/completions", json=body(script, stream=True))
            frames = data_frames(r.text)
            assert r.status_code == 200 and frames[-1] == "[DONE]", script
            assert frames[-2]["error"]["message"] == message and frames[-2]["error"]["type"] == "server_error"
            assert fold(frames)[0]["content"] == "par"
        r = await c.post("/v1/chat/completions", json=body("fails_late"))
        assert r.status_code == 500 and r.json()["error"]["message"] == "engine died"


def test_a_client_that_leaves_before_a_non_streamed_answer_cancels_its_generation():
    """With Serve's disconnect watcher off (`ingress.disconnects: app`) the route watches for the client itself: the
    generation is cancelled (so its engine request is aborted), not run to its end for nobody."""
    import asyncio

    cancelled = []

    class Slow(StubService):
        async def complete(self, prepared):
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(prepared.request_id)
                raise

    app = create_app(IngressContext(settings=SETTINGS, service=Slow(), secret=b"s"))
    raw = json.dumps(body("think_call")).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000), "server": ("t", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}

    async def run():
        pending = [{"type": "http.request", "body": raw, "more_body": False}]
        left = asyncio.Event()
        sent = []

        async def receive():
            if pending:
                return pending.pop(0)
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        call = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.sleep(0.3)
        assert not call.done() and not cancelled  # generating, the client still there
        left.set()
        await asyncio.wait_for(call, 10)
        return sent

    sent = asyncio.run(run())
    assert len(cancelled) == 1
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499, sent
