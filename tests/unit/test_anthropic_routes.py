"""A stand-in GenerationService for unit tests of the Anthropic routes (no Ray, no engine): it replays synthetic
event lists chosen by `nvext.forced_script`, so the real anthropic SDK can parse the bytes the routes produce.
Integration tests use the real service and engine."""

from __future__ import annotations

import asyncio
import uuid

from serve_app.conversation import (
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from serve_app.errors import Overloaded, PromptTooLong, ServiceError
from serve_app.ingress.context import IngressContext
from serve_app.service import PreparedRequest
from serve_app.settings import AppSettings

SECRET = b"unit-test-secret"
CACHED = 3


def prompt_len(conv) -> int:
    """A deterministic stand-in for tokenization: one token per 4 characters of every part, plus tools."""
    n = 10
    for m in conv.messages:
        for p in m.parts:
            n += len(repr(p)) // 4
    n += sum(len(repr(t)) // 4 for t in conv.tools)
    return n


def script(name: str, n_prompt: int) -> list:
    u0 = Usage(n_prompt, 0, cached_tokens=CACHED, estimated=True)

    def end(reason="stop", completion=7, **kw):
        return [Usage(n_prompt, completion, cached_tokens=CACHED), Finish(reason, **kw)]

    if name == "text":
        return [u0, TextDelta("Hel"), TextDelta("lo"), *end()]
    if name == "think_text_tool":
        return [
            u0,
            ReasoningDelta("Let me "),
            ReasoningDelta("look."),
            TextDelta("\n\n"),
            TextDelta("I'll list."),
            ToolCallStart(0, "call_abc123", "Bash"),
            ToolCallArgsDelta(0, '{"command": '),
            ToolCallArgsDelta(0, '"ls"}'),
            ToolCallEnd(0),
            *end("tool_calls"),
        ]
    if name == "interleaved":
        return [
            u0,
            ReasoningDelta("first"),
            ToolCallStart(0, "call_1", "Read"),
            ToolCallArgsDelta(0, '{"path": "a"}'),
            ToolCallEnd(0),
            ReasoningDelta("second"),
            ToolCallStart(1, "call_2", "Read"),
            ToolCallArgsDelta(1, '{"path": "b"}'),
            ToolCallEnd(1),
            *end("tool_calls"),
        ]
    if name == "stop_seq":
        return [u0, TextDelta("one two"), *end("stop_sequence", stop_sequence="THREE")]
    if name == "length":
        return [u0, TextDelta("truncated"), *end("length")]
    if name == "midstream_error":
        return [u0, TextDelta("partial"), Finish("error", error="replica died", error_kind="overloaded")]
    if name == "routing_overload":
        return [Finish("error", error="no replica can take it", error_kind="overloaded")]
    if name == "slow":
        return [u0, "sleep", TextDelta("late"), *end()]
    raise KeyError(name)


class FakeService:
    def __init__(self, settings: AppSettings):
        self.settings = settings
        self.closed = 0
        self.conversations: list = []  # as prepared

    def resolve_model(self, model_id):
        from serve_app.errors import ModelNotFound

        m = self.settings.find_model(model_id)
        if m is None:
            raise ModelNotFound(model_id)
        return m

    async def count_tokens(self, conv, opts, model_id):
        self.resolve_model(model_id)
        return prompt_len(conv)

    async def prepare(self, conv, opts, model_id, received=None, routed=None):
        model = self.resolve_model(model_id)
        self.conversations.append(conv)
        fs = opts.forced_script or "text"
        if fs.startswith("raise:"):
            kind = fs.split(":", 1)[1]
            if kind == "overloaded":
                raise Overloaded(retry_after=2.5)
            if kind == "too_long":
                raise PromptTooLong(300000, 200000)
            raise ServiceError(kind, f"forced {kind}", retry_after=1.0 if kind == "rate_limit" else None)
        return PreparedRequest(
            request_id=uuid.uuid4().hex,
            model_id=model_id,
            model=model,
            conversation=conv,
            options=opts,
            prompt_token_ids=list(range(prompt_len(conv))),
            max_tokens=min(opts.max_tokens or 16, model.max_output_tokens),
        )

    async def stream(self, prepared):
        try:
            for ev in script(prepared.options.forced_script or "text", prepared.num_prompt_tokens):
                if ev == "sleep":
                    await asyncio.sleep(0.3)
                    continue
                yield ev
        finally:
            self.closed += 1

    async def complete(self, prepared):
        return [ev async for ev in self.stream(prepared)]


def make_settings(api_keys=(), ping=10.0, **ingress) -> AppSettings:
    return AppSettings.model_validate(
        {
            "models": [
                {
                    "id": "test-model",
                    "aliases": ["claude-test"],
                    "display_name": "Test Model",
                    "max_model_len": 8192,
                    "max_output_tokens": 1024,
                }
            ],
            "ingress": {"api_keys": list(api_keys), "ping_interval_s": ping, "max_body_bytes": 200_000,
                        "tenants": {k["tenant"]: {} for k in api_keys if isinstance(k, dict)}, **ingress},
        }
    )


def make_app(api_keys=(), ping=10.0, **ingress):
    from fastapi import FastAPI

    from serve_app.ingress.anthropic import routes

    settings = make_settings(api_keys, ping, **ingress)
    service = FakeService(settings)
    app = FastAPI()
    app.state.ctx = IngressContext(settings=settings, service=service, secret=SECRET)
    app.include_router(routes.router)
    return app, service


# ------------------------------------------------------------------------------------------------------------------
# Tests: the real anthropic SDK parses the bytes the routes produce (over an in-process ASGI transport).

import anthropic  # noqa: E402
import httpx2  # noqa: E402  (the transport the anthropic SDK is built on)
import pytest  # noqa: E402

from serve_app.ingress.anthropic import signatures  # noqa: E402
from serve_app.keyring import for_tenant  # noqa: E402
from serve_app.tenants import DEFAULT  # noqa: E402

USER = [{"role": "user", "content": "hi"}]


def sdk(app, api_key="k", max_retries=0):
    return anthropic.AsyncAnthropic(
        api_key=api_key,
        base_url="http://test",
        max_retries=max_retries,
        http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app), base_url="http://test"),
    )


def raw(app):
    return httpx2.AsyncClient(transport=httpx2.ASGITransport(app), base_url="http://test")


def body(script="text", **kw):
    b = {"model": "test-model", "max_tokens": 50, "messages": USER, "nvext": {"forced_script": script}}
    b.update(kw)
    return b


async def test_create_and_stream_agree_and_the_sdk_accumulator_accepts_the_stream():
    app, _ = make_app()
    client = sdk(app)
    args = dict(model="test-model", max_tokens=50, messages=USER, thinking={"type": "adaptive"},
                extra_body={"nvext": {"forced_script": "think_text_tool"}})
    created = await client.messages.create(**args)
    async with client.messages.stream(**args) as stream:
        streamed = await stream.get_final_message()
    for m in (created, streamed):
        assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
        assert m.content[0].thinking == "Let me look."
        # Signed with the default tenant's key (keyring.for_tenant), not the server key itself.
        assert signatures.verify(for_tenant(SECRET, DEFAULT), "Let me look.", m.content[0].signature)
        assert not signatures.verify(SECRET, "Let me look.", m.content[0].signature)
        assert m.content[1].text == "\n\nI'll list."
        assert m.content[2].id == "toolu_abc123" and m.content[2].input == {"command": "ls"}
        assert m.stop_reason == "tool_use" and m.stop_sequence is None
        assert m.usage.output_tokens == 7 and m.usage.cache_read_input_tokens == CACHED
    assert created.model_dump(exclude={"id"}) == streamed.model_dump(exclude={"id"})


async def test_count_tokens_equals_input_plus_cache_read_and_takes_the_beta_query():
    app, _ = make_app()
    client = sdk(app)
    tools = [{"name": "Bash", "description": "run a command", "input_schema": {"type": "object", "properties": {
        "command": {"type": "string"}}}}]
    system = [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}]
    counted = await client.messages.count_tokens(model="test-model", messages=USER, tools=tools, system=system)
    msg = await client.messages.create(model="test-model", max_tokens=5, messages=USER, tools=tools, system=system)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    async with raw(app) as c:
        r = await c.post("/v1/messages/count_tokens?beta=true", json={"model": "test-model", "messages": USER})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0 and r.headers["request-id"].startswith("req_")
        r2 = await c.post("/v1/messages?beta=true", json=body())
        assert r2.status_code == 200 and r2.json()["content"] == [{"type": "text", "text": "Hello"}]


async def test_thinking_is_dropped_when_not_requested():
    app, _ = make_app()
    m = await sdk(app).messages.create(model="test-model", max_tokens=5, messages=USER,
                                       extra_body={"nvext": {"forced_script": "think_text_tool"}})
    assert [b.type for b in m.content] == ["text", "tool_use"]


async def test_interleaved_tools_stream_in_order_through_the_sdk():
    app, _ = make_app()
    async with sdk(app).messages.stream(model="test-model", max_tokens=2048, messages=USER, thinking={"type": "enabled",
                                        "budget_tokens": 1024}, extra_body={"nvext": {"forced_script": "interleaved"}}) as s:
        kinds = [ev.type async for ev in s]
        m = await s.get_final_message()
    assert [b.type for b in m.content] == ["thinking", "tool_use", "thinking", "tool_use"]
    assert [b.input for b in m.content if b.type == "tool_use"] == [{"path": "a"}, {"path": "b"}]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


async def test_omitted_thinking_streams_only_a_signature_and_the_next_turn_is_accepted():
    app, _ = make_app()
    client = sdk(app)
    thinking = {"type": "adaptive", "display": "omitted"}
    async with client.messages.stream(model="test-model", max_tokens=2048, messages=USER, thinking=thinking,
                                      extra_body={"nvext": {"forced_script": "think_text_tool"}}) as s:
        kinds = [ev.type async for ev in s]
        m = await s.get_final_message()
    assert "thinking" not in kinds  # no thinking deltas: the SDK's `thinking` event never fires
    assert m.content[0].type == "thinking" and m.content[0].thinking == "" and m.content[0].signature.startswith("sa2.")
    follow = [*USER, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[-1].id, "content": "ok"}]}]
    again = await client.messages.create(model="test-model", max_tokens=2048, messages=follow, thinking=thinking)
    assert again.stop_reason == "end_turn"  # the signature verified (test_anthropic_convert: the text came back)
    follow[1]["content"][0]["signature"] = m.content[0].signature[:-8] + "AAAAAAAA"
    with pytest.raises(anthropic.BadRequestError) as e:
        await client.messages.create(model="test-model", max_tokens=2048, messages=follow, thinking=thinking)
    assert e.value.body["error"]["message"] == "messages.1.content.0: Invalid `signature` in `thinking` block"


@pytest.mark.parametrize("display", ["summarized", "omitted"])
async def test_a_thinking_signature_is_its_tenants_alone(display):
    """Thinking signatures are made with the tenant's own keys (keyring.for_tenant): a block signed for one
    tenant is refused, in the API's words, when another sends it back, sealed text (`display: "omitted"`) or not.
    One signed with the server key itself (before tenants had keys of their own) verifies for every tenant."""
    app, service = make_app(api_keys=[{"key": "key-a", "tenant": "alice"}, {"key": "key-b", "tenant": "bob"}])
    alice, bob = sdk(app, api_key="key-a"), sdk(app, api_key="key-b")
    thinking = {"type": "adaptive", "display": display}
    m = await alice.messages.create(model="test-model", max_tokens=2048, messages=USER, thinking=thinking,
                                    extra_body={"nvext": {"forced_script": "think_text_tool"}})
    follow = [*USER, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[-1].id, "content": "ok"}]}]
    assert (await alice.messages.create(model="test-model", max_tokens=2048, messages=follow,
                                        thinking=thinking)).stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as e:
        await bob.messages.create(model="test-model", max_tokens=2048, messages=follow, thinking=thinking)
    assert e.value.body["error"]["message"] == "messages.1.content.0: Invalid `signature` in `thinking` block"
    follow[1]["content"][0] = {"type": "thinking", "thinking": "Let me look.",
                               "signature": signatures.sign(SECRET, "Let me look.")}
    for tenant in (alice, bob):
        assert (await tenant.messages.create(model="test-model", max_tokens=2048, messages=follow,
                                             thinking=thinking)).stop_reason == "end_turn"
        assert service.conversations[-1].messages[1].parts[0].text == "Let me look."
    # Once the operator stops accepting them (ingress.accept_server_key_items), only the tenant's own verify.
    strict, _ = make_app(api_keys=[{"key": "key-a", "tenant": "alice"}], accept_server_key_items=False)
    with pytest.raises(anthropic.BadRequestError) as e:
        await sdk(strict, api_key="key-a").messages.create(model="test-model", max_tokens=2048, messages=follow,
                                                          thinking=thinking)
    assert e.value.body["error"]["message"] == "messages.1.content.0: Invalid `signature` in `thinking` block"


async def test_stream_wire_format():
    app, _ = make_app()
    async with raw(app) as c:
        r = await c.post("/v1/messages", json=body("stop_seq", stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in r.text.split("\n\n") if f]
    names = [f.split("\n")[0] for f in frames]
    # The API's own order: a ping right behind message_start, before the first block.
    assert names == ["event: message_start", "event: ping", "event: content_block_start",
                     "event: content_block_delta", "event: content_block_stop", "event: message_delta",
                     "event: message_stop"]
    assert '"stop_reason":"stop_sequence","stop_sequence":"THREE"' in frames[5]


async def test_stop_sequence_and_max_tokens_via_sdk():
    app, _ = make_app()
    client = sdk(app)
    m = await client.messages.create(**{k: v for k, v in body("stop_seq").items() if k != "nvext"},
                                     extra_body={"nvext": {"forced_script": "stop_seq"}}, stop_sequences=["THREE"])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "THREE")
    m = await client.messages.create(model="test-model", max_tokens=2, messages=USER,
                                     extra_body={"nvext": {"forced_script": "length"}})
    assert m.stop_reason == "max_tokens"


async def test_max_tokens_zero_prewarms_and_answers_nothing():
    """The API's cache pre-warming: the prompt is processed (and cached), the answer has no content."""
    app, _ = make_app()
    m = await sdk(app).messages.create(model="test-model", max_tokens=0, messages=USER,
                                       extra_body={"nvext": {"forced_script": "think_text_tool"}})
    assert m.content == [] and m.stop_reason == "max_tokens" and m.usage.output_tokens == 0
    assert m.usage.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError):
        await sdk(app).messages.create(model="test-model", max_tokens=-1, messages=USER)


async def test_ping_while_waiting():
    app, _ = make_app(ping=0.02)  # the fake stream sleeps 0.3 s between the routed Usage and the first text
    async with raw(app) as c:
        r = await c.post("/v1/messages", json=body("slow", stream=True))
    names = [f.split("\n")[0] for f in r.text.split("\n\n") if f]
    assert names[0] == "event: message_start"
    assert "event: ping" in names and names.index("event: ping") < names.index("event: content_block_start")
    assert names[-1] == "event: message_stop"
    async with sdk(app).messages.stream(**{k: v for k, v in body("slow").items() if k != "nvext"},
                                        extra_body={"nvext": {"forced_script": "slow"}}) as s:
        assert (await s.get_final_message()).content[0].text == "late"


async def test_midstream_error_is_an_error_event_and_the_sdk_raises_it():
    app, _ = make_app()
    async with raw(app) as c:
        r = await c.post("/v1/messages", json=body("midstream_error", stream=True))
    assert r.status_code == 200
    frames = [f for f in r.text.split("\n\n") if f]
    assert frames[-1] == ('event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
                          '"message":"replica died"}}')
    with pytest.raises(anthropic.APIStatusError) as e:
        async with sdk(app).messages.stream(model="test-model", max_tokens=5, messages=USER,
                                            extra_body={"nvext": {"forced_script": "midstream_error"}}) as s:
            await s.get_final_message()
    assert "replica died" in str(e.value)


def _envelope(r, status, etype):
    assert r.status_code == status, r.text
    j = r.json()
    assert j["type"] == "error" and j["error"]["type"] == etype and j["error"]["message"]
    assert r.headers["request-id"].startswith("req_") and j["request_id"] == r.headers["request-id"]
    return j


async def test_every_error_status_in_the_anthropic_envelope():
    app, _ = make_app()
    async with raw(app) as c:
        j = _envelope(await c.post("/v1/messages", json=body(model="nope")), 404, "not_found_error")
        assert j["error"]["message"] == "model: nope"
        j = _envelope(await c.post("/v1/messages", json=body("raise:too_long")), 400, "invalid_request_error")
        assert j["error"]["message"] == "prompt is too long: 300000 tokens > 200000 maximum"
        j = _envelope(await c.post("/v1/messages", json={"model": "test-model", "messages": USER}), 400,
                      "invalid_request_error")
        assert j["error"]["message"].startswith("max_tokens: Field required")
        _envelope(await c.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"}),
                  400, "invalid_request_error")
        _envelope(await c.post("/v1/messages", json=body(messages=[{"role": "user", "content": "x" * 300_000}])),
                  413, "request_too_large")
        r = await c.post("/v1/messages", json=body("raise:rate_limit"))
        _envelope(r, 429, "rate_limit_error")
        assert r.headers["retry-after"] == "1"
        r = await c.post("/v1/messages", json=body("raise:overloaded", stream=True))
        _envelope(r, 529, "overloaded_error")
        assert r.headers["retry-after"] == "3" and r.headers["retry-after-ms"] == "2500"
        _envelope(await c.post("/v1/messages", json=body("raise:api_error")), 500, "api_error")
        _envelope(await c.post("/v1/messages", json=body("raise:permission")), 403, "permission_error")
        # A refusal before any output keeps its HTTP status even on a stream.
        _envelope(await c.post("/v1/messages", json=body("routing_overload", stream=True)), 529, "overloaded_error")
        _envelope(await c.post("/v1/messages", json=body("routing_overload")), 529, "overloaded_error")
        _envelope(await c.post("/v1/messages/count_tokens", json={"model": "nope", "messages": USER}), 404,
                  "not_found_error")


async def test_sdk_maps_statuses_to_its_error_classes():
    app, _ = make_app()
    client = sdk(app)
    cases = [("raise:rate_limit", anthropic.RateLimitError), ("raise:too_long", anthropic.BadRequestError),
             ("raise:overloaded", anthropic.OverloadedError), ("raise:api_error", anthropic.InternalServerError)]
    for script, exc in cases:
        with pytest.raises(exc):
            await client.messages.create(model="test-model", max_tokens=5, messages=USER,
                                         extra_body={"nvext": {"forced_script": script}})
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="unknown", max_tokens=5, messages=USER)


async def test_auth_accepts_x_api_key_or_bearer():
    app, _ = make_app(api_keys=["sekret"])
    async with raw(app) as c:
        _envelope(await c.post("/v1/messages", json=body()), 401, "authentication_error")
        _envelope(await c.post("/v1/messages", json=body(), headers={"x-api-key": "wrong"}), 401,
                  "authentication_error")
        assert (await c.post("/v1/messages", json=body(), headers={"x-api-key": "sekret"})).status_code == 200
        assert (await c.post("/v1/messages", json=body(), headers={"authorization": "Bearer sekret"})).status_code == 200
        _envelope(await c.post("/v1/messages/count_tokens", json={"model": "test-model", "messages": USER}), 401,
                  "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        await sdk(app, api_key="bad").messages.create(model="test-model", max_tokens=5, messages=USER)
    m = await sdk(app, api_key="sekret").messages.create(model="test-model", max_tokens=5, messages=USER)
    assert m.content[0].text == "Hello"


async def test_head_root_answers():
    app, _ = make_app()
    async with raw(app) as c:
        assert (await c.head("/")).status_code == 200


async def test_signed_thinking_round_trips_and_tampering_is_refused():
    app, _ = make_app()
    client = sdk(app)
    args = dict(model="test-model", max_tokens=50, thinking={"type": "adaptive"},
                extra_body={"nvext": {"forced_script": "think_text_tool"}})
    first = await client.messages.create(messages=USER, **args)
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": first.content[2].id,
                                             "content": "a.txt"}]}]
    again = await client.messages.create(messages=history, **args)
    assert again.stop_reason == "tool_use"
    history[1]["content"][0]["thinking"] = "Let me cheat."
    with pytest.raises(anthropic.BadRequestError) as e:
        await client.messages.create(messages=history, **args)
    assert "Invalid `signature` in `thinking` block" in str(e.value)


async def test_client_disconnect_closes_the_generation():
    """Drive the ASGI app by hand: the client goes away after the first frame; the service stream must be closed
    (which aborts the engine request) and the response must stop there."""
    import json as _json

    app, service = make_app(ping=0.02)
    payload = _json.dumps(body("slow", stream=True)).encode()
    first_frame = asyncio.Event()
    sent: list[bytes] = []
    request_sent = False

    async def receive():
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await first_frame.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            sent.append(message["body"])
            first_frame.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/messages", "raw_path": b"/v1/messages",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json"),
             (b"content-length", str(len(payload)).encode())], "client": ("t", 1), "server": ("test", 80)}
    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    text = b"".join(sent).decode()
    assert text.startswith("event: message_start")
    assert "message_stop" not in text and "late" not in text
    assert service.closed == 1
