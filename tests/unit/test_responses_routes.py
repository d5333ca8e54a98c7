"""The /v1/responses routes in the real FastAPI app (no Ray, no engine): a stand-in GenerationService replays a
synthetic event list chosen by `nvext.forced_script`; the real `openai` SDK talks to the app over ASGI. Two app
instances sharing one store core stand for two ingress replicas sharing the external store. The real service and
engine are exercised by tests/integration/test_responses_api.py."""

from __future__ import annotations

import gzip
import json
import uuid

import httpx
import openai
import pytest
import zstandard

from serve_app.conversation import Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, Usage
from serve_app.errors import RESPONSES_CONTEXT_EXCEEDED, ModelNotFound, Overloaded, PromptTooLong
from serve_app.ingress.context import IngressContext
from serve_app.ingress.responses.convert import DOCUMENTED_ITEMS, HANDLED_ITEMS, refuse_item
from serve_app.ingress.responses.store import ResponseStoreCore, StoreClient
from serve_app.ingress.server import create_app
from serve_app.service import PreparedRequest
from serve_app.settings import AppSettings

SETTINGS = AppSettings.model_validate({"models": [{"id": "m1", "reasoning_parser": "qwen3"}]})


def script(name: str, n: int) -> list:
    end = [Usage(n, 5, cached_tokens=2, reasoning_tokens=2)]
    if name == "text":
        return [Usage(n, 0, estimated=True), TextDelta("Hello"), *end, Finish("stop")]
    if name == "think_call":
        return [ReasoningDelta("I should "), ReasoningDelta("run ls."), ToolCallStart(0, "call_1", "exec_command"),
                ToolCallArgsDelta(0, '{"cmd": "ls"}'), ToolCallEnd(0), *end, Finish("tool_calls")]
    if name == "error":
        return [TextDelta("par"), Finish("error", error="engine died", error_kind="api_error")]
    if name == "engine_full":  # the engine refused it: its queue is full
        return [Finish("error", error="the engine queue is full, retry shortly", error_kind="overloaded")]
    raise KeyError(name)


class StubService:
    def __init__(self):
        self.prepared: list[PreparedRequest] = []

    def resolve_model(self, model_id):
        m = SETTINGS.find_model(model_id)
        if m is None:
            raise ModelNotFound(model_id)
        return m

    async def prepare(self, conv, opts, model_id, received=None, routed=None):
        model = self.resolve_model(model_id)
        if opts.forced_script == "raise:too_long":
            raise PromptTooLong(9000, 8192)
        if opts.forced_script == "raise:overloaded":
            raise Overloaded(retry_after=2)
        p = PreparedRequest(request_id=uuid.uuid4().hex, model_id=model_id, model=model, conversation=conv,
                            options=opts, prompt_token_ids=list(range(10 * len(conv.messages))), max_tokens=16)
        self.prepared.append(p)
        return p

    async def stream(self, prepared):
        for ev in script(prepared.options.forced_script or "text", prepared.num_prompt_tokens):
            yield ev

    async def complete(self, prepared):
        return [ev async for ev in self.stream(prepared)]


class CountingStore(ResponseStoreCore):
    """The in-memory store, counting the chains and single records (`head`) read from it."""

    chains = heads = 0

    def chain(self, key, links=False):
        self.chains += 1
        return super().chain(key, links)

    def head(self, key):
        self.heads += 1
        return super().head(key)


@pytest.fixture(params=[0, 1 << 20], ids=["store", "recent"])
def replicas(request):
    """Two ingress apps ("replicas") with one shared store and one server secret; each keeps the records it stored
    to read chains from (`recent`: ingress/responses/recent.py) or reads every chain from the store."""
    store = CountingStore(max_items=100, ttl_s=600)
    apps = []
    for _ in range(2):
        svc = StubService()
        app = create_app(IngressContext(settings=SETTINGS, service=svc, secret=b"s3cret",
                                        response_store=StoreClient(store, recent_bytes=request.param)))
        apps.append((app, svc))
    return apps


def client(app) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key="x", base_url="http://app/v1", max_retries=0,
                              http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))


def raw(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


async def test_create_non_streaming(replicas):
    app, svc = replicas[0]
    resp = await client(app).responses.create(model="m1", input="hi", instructions="be brief", metadata={"k": "v"})
    assert resp.status == "completed" and resp.output_text == "Hello"
    assert resp.instructions == "be brief" and resp.metadata == {"k": "v"} and resp.model == "m1"
    assert resp.usage.input_tokens == 20 and resp.usage.output_tokens == 5 and resp.usage.total_tokens == 25
    assert resp.usage.input_tokens_details.cached_tokens == 2
    conv = svc.prepared[0].conversation
    assert [m.role for m in conv.messages] == ["system", "user"]


async def test_stream_with_sdk_and_get_from_other_replica(replicas):
    (a, _), (b, _) = replicas
    async with client(a).responses.stream(model="m1", input="run ls",
                                          extra_body={"nvext": {"forced_script": "think_call"}}) as stream:
        types = [e.type async for e in stream]
        final = await stream.get_final_response()
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    got = await client(b).responses.retrieve(final.id)
    assert got.id == final.id and [o.id for o in got.output] == [o.id for o in final.output]
    await client(a).responses.delete(final.id)
    with pytest.raises(openai.NotFoundError):
        await client(b).responses.retrieve(final.id)
    with pytest.raises(openai.NotFoundError):
        await client(b).responses.delete(final.id)


@pytest.mark.parametrize("reasoning,channel", [
    (None, "content"), ({"summary": "none"}, "content"), ({"effort": "low"}, "content"),
    ({"summary": "auto"}, "summary"), ({"summary": "concise"}, "summary"), ({"summary": "detailed"}, "summary"),
    ({"generate_summary": "auto"}, "summary"),  # the deprecated name the SDK still declares
])
async def test_reasoning_goes_out_on_the_channel_asked_for(replicas, reasoning, channel):
    app, _ = replicas[0]
    extra = {"nvext": {"forced_script": "think_call"}, **({"reasoning": reasoning} if reasoning else {})}
    events = [e async for e in await client(app).responses.create(model="m1", input="q", stream=True,
                                                                   extra_body=extra)]
    deltas = [e for e in events if e.type in ("response.reasoning_text.delta",
                                               "response.reasoning_summary_text.delta")]
    assert "".join(e.delta for e in deltas) == "I should run ls."
    assert {e.type for e in deltas} == {"response.reasoning_summary_text.delta" if channel == "summary"
                                        else "response.reasoning_text.delta"}
    item = events[-1].response.output[0]
    texts = [p.text for p in item.summary] + [p.text for p in item.content or []]
    assert texts == ["I should run ls."] and bool(item.summary) == (channel == "summary")


async def test_previous_response_id_across_replicas(replicas):
    (a, _), (b, svc_b) = replicas
    first = await client(a).responses.create(model="m1", input="first question", instructions="sys")
    await client(b).responses.create(model="m1", input="second", previous_response_id=first.id)
    conv = svc_b.prepared[-1].conversation
    texts = [(m.role, m.parts[0].text) for m in conv.messages]
    assert texts == [("user", "first question"), ("assistant", "Hello"), ("user", "second")]


def _turns(conv) -> list[tuple[str, str]]:
    return [(m.role, m.parts[0].text) for m in conv.messages]


async def _session(apps: list, turns: int) -> list[str]:
    """A session of `turns` turns ("q0", "q1", ...), each continuing the last by id, turn n through
    apps[n % len(apps)]; the responses' ids."""
    ids, previous = [], None
    for n in range(turns):
        r = await client(apps[n % len(apps)]).responses.create(model="m1", input=f"q{n}",
                                                               previous_response_id=previous)
        ids.append(previous := r.id)
    return ids


async def test_a_chain_of_previous_response_ids_stores_each_turn_once(replicas):
    """Each stored response holds its own turn (input, then output) and names the one it continues; a follow-up
    gets the whole chain's history, through either replica, also past a response deleted on the way."""
    (a, _), (b, svc_b) = replicas
    store = _store(a)
    ids = await _session([a, b], 4)
    assert [store.get(i)["items"] for i in ids] == [
        [{"type": "message", "role": "user", "content": f"q{n}"}, *store.get(ids[n])["response"]["output"]]
        for n in range(4)]
    assert _turns(svc_b.prepared[-1].conversation) == [
        ("user", "q0"), ("assistant", "Hello"), ("user", "q1"), ("assistant", "Hello"),
        ("user", "q2"), ("assistant", "Hello"), ("user", "q3")]
    await client(b).responses.delete(ids[1])
    with pytest.raises(openai.NotFoundError):
        await client(a).responses.create(model="m1", input="x", previous_response_id=ids[1])
    await client(b).responses.create(model="m1", input="q4", previous_response_id=ids[3])
    assert _turns(svc_b.prepared[-1].conversation)[:4] == [
        ("user", "q0"), ("assistant", "Hello"), ("user", "q1"), ("assistant", "Hello")]


async def test_a_response_whose_chain_went_while_it_was_generated_is_stored_whole(replicas):
    (a, svc), _ = replicas
    store = _store(a)
    first = await client(a).responses.create(model="m1", input="q0")
    prepare = svc.prepare

    async def prepare_and_lose_the_chain(*args, **kwargs):
        store.delete(first.id)  # expired or evicted between the lookup and the put
        return await prepare(*args, **kwargs)

    svc.prepare = prepare_and_lose_the_chain
    second = await client(a).responses.create(model="m1", input="q1", previous_response_id=first.id)
    svc.prepare = prepare
    assert store.get(first.id) is None and store.chain(second.id) == [store.get(second.id)]
    await client(a).responses.create(model="m1", input="q2", previous_response_id=second.id)
    assert _turns(svc.prepared[-1].conversation) == [
        ("user", "q0"), ("assistant", "Hello"), ("user", "q1"), ("assistant", "Hello"), ("user", "q2")]


def _store(app) -> ResponseStoreCore:
    return app.state.ctx.response_store.backend


@pytest.mark.parametrize("replicas", [1 << 20], indirect=True, ids=["recent"])
async def test_a_replica_reads_the_chains_it_stored_from_memory_and_the_store_says_what_is_gone(replicas):
    """A session continued through the replica that stored its turns reads its history from that replica's
    records (the store is asked only whether the last one is visible), the same history the store gives; deleted,
    expired or evicted through anyone, it is not found, as from the store."""
    (a, svc_a), (b, svc_b) = replicas
    store = _store(a)
    ids = await _session([a], 4)
    assert store.chains == 0 and a.state.ctx.response_store.recent.served == 3
    await client(b).responses.create(model="m1", input="q4", previous_response_id=ids[-1])  # b holds none of them
    assert store.chains == 1
    # The same history from memory (a, turn q3) as from the store (b, which adds q3's answer and q4).
    assert _turns(svc_b.prepared[-1].conversation)[:-2] == _turns(svc_a.prepared[-1].conversation)

    await client(b).responses.delete(ids[2])  # through the other replica: only the store knows
    with pytest.raises(openai.NotFoundError):
        await client(a).responses.create(model="m1", input="x", previous_response_id=ids[2])
    # ids[3] continues the deleted one, which the store keeps hidden for its chain: still the whole history.
    await client(a).responses.create(model="m1", input="q5", previous_response_id=ids[3])
    assert _turns(svc_a.prepared[-1].conversation)[:6] == [
        ("user", "q0"), ("assistant", "Hello"), ("user", "q1"), ("assistant", "Hello"), ("user", "q2"),
        ("assistant", "Hello")]

    await client(a).responses.delete(ids[1])  # through this replica: forgotten here, hidden in the store
    chains = store.chains
    await client(a).responses.create(model="m1", input="q6", previous_response_id=ids[3])
    assert store.chains == chains + 1  # a record of the chain is no longer here: read from the store whole
    assert _turns(svc_a.prepared[-1].conversation)[:2] == [("user", "q0"), ("assistant", "Hello")]

    store.clock = lambda: 10**9  # every conversation expired
    with pytest.raises(openai.NotFoundError):
        await client(a).responses.create(model="m1", input="x", previous_response_id=ids[3])


@pytest.mark.parametrize("replicas", [1 << 20], indirect=True, ids=["recent"])
async def test_a_session_alternating_replicas_reads_one_record_a_turn(replicas):
    """Each replica keeps the records it read as well as those it stored: a session whose turns alternate between
    two replicas reads, each turn, only the record the other replica stored, never the whole chain again."""
    (a, svc_a), (b, svc_b) = replicas
    store = _store(a)
    await _session([a, b], 6)
    assert store.chains == 0 and store.heads == 5
    assert _turns(svc_b.prepared[-1].conversation) == [
        turn for n in range(5) for turn in (("user", f"q{n}"), ("assistant", "Hello"))] + [("user", "q5")]
    assert a.state.ctx.response_store.recent.extended == 2 and b.state.ctx.response_store.recent.extended == 3


async def test_a_reader_that_stores_nothing_reads_each_new_turn_alone():
    """The front door's Router reads every continuation's chain and stores nothing: from its second read of a
    session on, it reads only the newest record. One that comes to a session late reads it whole once."""
    store = CountingStore(max_items=100, ttl_s=600)
    writer, reader, late = (StoreClient(store, recent_bytes=b) for b in (0, 1 << 20, 1 << 20))
    previous = None
    for n in range(8):
        key = f"r{n}"
        assert await writer.put(key, {"items": [n]}, previous)
        previous = key
        chains = store.chains
        assert [r["items"][0] for r in await reader.chain(key)] == list(range(n + 1))
        assert store.chains == chains  # the reader's: the newest record alone
        if n >= 4:
            assert [r["items"][0] for r in await late.chain(key)] == list(range(n + 1))
            assert store.chains == chains + (n == 4)  # the late one's: whole the first time, then the newest
    assert store.heads == 8 + 4
    store.delete("r7")
    assert await reader.chain("r7") is None and await late.chain("r7") is None
    assert [r["items"][0] for r in await reader.chain("r6")] == list(range(7))


def test_recent_records_are_bounded_and_a_chain_missing_a_record_is_not_theirs():
    from serve_app.ingress.responses.recent import RecentRecords

    record = {"items": [{"type": "message", "role": "user", "content": "x" * 100}]}
    size = len(json.dumps(record, separators=(",", ":")))
    recent = RecentRecords(3 * size)
    for n in range(4):
        recent.remember(f"r{n}", record, f"r{n - 1}" if n else None)
    assert len(recent) == 3 and recent.bytes == 3 * size  # r0, the least recently used, went
    assert recent.chain("r3") is None  # its chain reaches r0: read from the store
    recent.remember("s0", record, None)  # r1 goes now
    recent.remember("s1", record, "s0")
    assert recent.chain("s1") == [record, record] and recent.chain("r2") is None
    recent.forget("s0")
    assert recent.chain("s1") is None and recent.bytes == 2 * size
    recent.remember("big", {"items": ["y" * 4 * size]}, None)  # larger than the bound: not kept
    assert recent.chain("big") is None and recent.bytes <= 3 * size


async def test_store_false_is_not_retrievable_and_unknown_id_404(replicas):
    app, _ = replicas[0]
    r = await client(app).responses.create(model="m1", input="x", store=False)
    with pytest.raises(openai.NotFoundError):
        await client(app).responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        await client(app).responses.retrieve("resp_unknown")
    with pytest.raises(openai.NotFoundError) as e:
        await client(app).responses.create(model="m1", input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"


async def test_encrypted_reasoning_round_trip_and_tamper(replicas):
    (a, _), (b, svc_b) = replicas
    r = await client(a).responses.create(model="m1", input="q", include=["reasoning.encrypted_content"], store=False,
                                         extra_body={"nvext": {"forced_script": "think_call"}})
    rs = r.output[0]
    assert rs.type == "reasoning" and rs.encrypted_content
    item = rs.model_dump(exclude_none=True)
    item["content"] = [{"type": "reasoning_text", "text": "edited by client"}]
    follow = [{"role": "user", "content": "q"}, item, r.output[1].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}]
    await client(b).responses.create(model="m1", input=follow, store=False)  # another replica opens it
    turn = svc_b.prepared[-1].conversation.messages[1]
    assert turn.role == "assistant" and turn.parts[0].text == "I should run ls."
    enc = item["encrypted_content"]
    item["encrypted_content"] = enc[:10] + ("A" if enc[10] != "A" else "B") + enc[11:]
    with pytest.raises(openai.BadRequestError) as e:
        await client(b).responses.create(model="m1", input=follow, store=False)
    assert "encrypted_content" in e.value.body["param"]


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
async def test_compressed_bodies(replicas, encoding):
    app, _ = replicas[0]
    data = json.dumps({"model": "m1", "input": "hi"}).encode()
    body = zstandard.ZstdCompressor(level=3).compress(data) if encoding == "zstd" else gzip.compress(data)
    async with raw(app) as c:
        r = await c.post("/v1/responses", content=body,
                         headers={"content-encoding": encoding, "content-type": "application/json"})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "Hello"


async def test_decompressed_size_cap(replicas):
    small = AppSettings.model_validate({"models": [{"id": "m1"}], "ingress": {"max_decompressed_bytes": 1000}})
    app = create_app(IngressContext(settings=small, service=StubService(), secret=b"s"))
    data = json.dumps({"model": "m1", "input": "x" * 5000}).encode()
    async with raw(app) as c:
        r = await c.post("/v1/responses", content=zstandard.ZstdCompressor().compress(data),
                         headers={"content-encoding": "zstd", "content-type": "application/json"})
    assert r.status_code == 413


@pytest.mark.parametrize("forced,retry_after", [("raise:overloaded", "2"), ("engine_full", "1")])
async def test_overload_streams_as_response_failed_and_is_http_503_otherwise(replicas, forced, retry_after):
    """A refusal (by the admission cap, or by the engine) reaches a streaming client in-stream as `response.failed`
    with `server_is_overloaded`, the code Codex reads as ServerOverloaded; not streaming, it is what OpenAI answers:
    503 with that code and retry-after (never Anthropic's 529, a status OpenAI clients do not know)."""
    app, _ = replicas[0]
    nvext = {"nvext": {"forced_script": forced}}
    events = [e async for e in await client(app).responses.create(model="m1", input="x", stream=True,
                                                                   extra_body=nvext)]
    assert [e.type for e in events][-1] == "response.failed"
    assert events[-1].response.error.code == "server_is_overloaded" and "retry" in events[-1].response.error.message
    with pytest.raises(openai.InternalServerError) as e:
        await client(app).responses.create(model="m1", input="x", extra_body=nvext)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == retry_after
    assert e.value.code == "server_is_overloaded" and e.value.type == "service_unavailable_error"


async def test_prompt_too_long_is_a_400_in_the_openai_envelope_when_not_streaming(replicas):
    app, _ = replicas[0]
    with pytest.raises(openai.BadRequestError) as e:
        await client(app).responses.create(model="m1", input="x",
                                           extra_body={"nvext": {"forced_script": "raise:too_long"}})
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    assert e.value.body["type"] == "invalid_request_error"
    assert e.value.param == "input"  # Responses' own name for the prompt (Chat says `messages`)
    # the Responses API's words, not Chat's ("This model's maximum context length is ...")
    assert e.value.body["message"] == RESPONSES_CONTEXT_EXCEEDED
    assert RESPONSES_CONTEXT_EXCEEDED == ("Your input exceeds the context window of this model. Please adjust your "
                                          "input and try again.")


async def test_prompt_too_long_streams_response_failed_with_the_code_codex_compacts_on(replicas):
    """Codex reads "context window exceeded" only from `response.failed` with `context_length_exceeded` (an HTTP
    400 ends its turn as an invalid request); the SDK's `ResponseError` enum lacks the member, the API sends it."""
    app, _ = replicas[0]
    events = [e async for e in await client(app).responses.create(
        model="m1", input="x", stream=True, extra_body={"nvext": {"forced_script": "raise:too_long"}})]
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    err = events[-1].response.error
    assert err.code == "context_length_exceeded" and err.message == RESPONSES_CONTEXT_EXCEEDED


async def test_midstream_error_is_response_failed_and_non_stream_is_http_error(replicas):
    app, _ = replicas[0]
    events = [e async for e in await client(app).responses.create(
        model="m1", input="x", stream=True, extra_body={"nvext": {"forced_script": "error"}})]
    assert events[-1].type == "response.failed" and events[-1].response.error.message == "engine died"
    with pytest.raises(openai.InternalServerError):
        await client(app).responses.create(model="m1", input="x", extra_body={"nvext": {"forced_script": "error"}})


async def test_bad_requests_are_400_naming_the_field(replicas):
    app, _ = replicas[0]
    with pytest.raises(openai.BadRequestError) as e:
        await client(app).responses.create(model="m1", input=[{"type": "function_call_output", "output": "x"}])
    assert e.value.body["param"] == "input.0.call_id"
    with pytest.raises(openai.NotFoundError):
        await client(app).responses.create(model="nope", input="x")


# -- input item types: each one the SDK defines is rendered or refused by name, never dropped -------------------


def _sdk_item_types() -> set[str]:
    import typing

    from openai.types.responses.response_input_item_param import ResponseInputItemParam

    def literals(t) -> list[str]:
        if typing.get_origin(t) is typing.Literal:
            return list(typing.get_args(t))
        return [v for a in typing.get_args(t) for v in literals(a)]

    return {v for m in typing.get_args(ResponseInputItemParam)
            for v in literals(typing.get_type_hints(m).get("type"))}


def test_the_documented_item_types_are_the_sdks_and_each_is_handled_or_refused():
    sdk = _sdk_item_types()
    assert set(DOCUMENTED_ITEMS) == sdk  # a type the SDK gains must be decided here: rendered or refused
    assert set(HANDLED_ITEMS) < sdk
    for t in sdk - set(HANDLED_ITEMS):
        assert "not supported by this server" in refuse_item(t, "input[0]").message


REFUSED = sorted(set(DOCUMENTED_ITEMS) - set(HANDLED_ITEMS))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("item_type", REFUSED)
async def test_a_documented_item_type_the_server_does_not_serve_is_a_400_naming_it(replicas, item_type, stream):
    """OpenAI's items for hosted tools, built-in client tools this server never offers, and server-side state:
    silently dropping one would hide part of the conversation from the model."""
    app, svc = replicas[0]
    items = [{"type": "message", "role": "user", "content": "hi"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"},
             {"type": item_type, "id": "x_1", "status": "completed"}]
    with pytest.raises(openai.BadRequestError) as e:
        await client(app).responses.create(model="m1", input=items, stream=stream)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == "input[3].type" and err["code"] == "unsupported_value"
    assert f"`{item_type}` items are not supported" in err["message"] and "input[3]" in err["message"]
    assert svc.prepared == []  # refused before generation


async def test_an_unknown_item_type_is_a_400_listing_the_supported_ones(replicas):
    app, svc = replicas[0]
    with pytest.raises(openai.BadRequestError) as e:
        await client(app).responses.create(model="m1", input=[{"type": "message", "role": "user", "content": "a"},
                                                               {"type": "telepathy_call", "thought": "b"}])
    err = e.value.body
    assert err["param"] == "input[1].type" and err["code"] == "invalid_value"
    assert "Invalid value: 'telepathy_call'" in err["message"] and "'function_call_output'" in err["message"]
    assert svc.prepared == []


async def test_every_handled_item_type_reaches_the_model(replicas):
    app, svc = replicas[0]
    items = [{"type": "message", "role": "developer", "content": "rules"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\": 1}"},
             {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin Patch"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "custom_tool_call_output", "call_id": "c2", "output": "two"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]}]
    assert {i["type"] for i in items} == set(HANDLED_ITEMS)
    resp = await client(app).responses.create(model="m1", input=items)
    assert resp.status == "completed"
    roles = [m.role for m in svc.prepared[0].conversation.messages]
    assert roles == ["developer", "user", "assistant", "tool", "tool", "assistant"]


# -- tool types: offered, or accepted and ignored, or a 400 for a type the SDK lacks (test_responses_tools.py) ----


def _codex_tools() -> list:
    """The tool types Codex sends (harness-contracts B5), built with the SDK's param types."""
    from openai.types.responses import CustomToolParam, FunctionToolParam, NamespaceToolParam, ToolSearchToolParam
    from openai.types.responses import WebSearchToolParam
    from openai.types.responses.tool_param import ImageGeneration, LocalShell

    return [FunctionToolParam(type="function", name="exec_command", strict=False,
                              parameters={"type": "object", "properties": {"cmd": {"type": "string"}}}),
            CustomToolParam(type="custom", name="apply_patch", format={"type": "grammar", "syntax": "lark",
                                                                       "definition": "start: /.+/"}),
            LocalShell(type="local_shell"), WebSearchToolParam(type="web_search", search_context_size="low"),
            ToolSearchToolParam(type="tool_search", execution="client"), ImageGeneration(type="image_generation"),
            NamespaceToolParam(type="namespace", name="crm", description="CRM", tools=[
                {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}])]


@pytest.mark.parametrize("stream", [False, True])
async def test_codex_tool_types_are_accepted_and_only_function_and_custom_reach_the_model(replicas, stream):
    """A 200 whose model saw only the function and custom tools; the response echoes the tools as sent, as the
    API does."""
    app, svc = replicas[0]
    tools = _codex_tools()
    if stream:
        async with client(app).responses.stream(model="m1", input="hi", tools=tools) as s:
            resp = await s.get_final_response()
    else:
        resp = await client(app).responses.create(model="m1", input="hi", tools=tools)
    assert resp.status == "completed"
    assert [t.type for t in resp.tools] == [t["type"] for t in tools]
    assert [(t.name, t.kind) for t in svc.prepared[0].conversation.tools] == [("exec_command", "function"),
                                                                             ("apply_patch", "custom")]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_tool_type_the_sdk_lacks_is_a_400_naming_it(replicas, stream):
    app, svc = replicas[0]
    with pytest.raises(openai.BadRequestError) as e:
        await client(app).responses.create(model="m1", input="hi", stream=stream,
                                           tools=[*_codex_tools()[:2], {"type": "telepathy"}])
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == "tools[2].type" and err["code"] == "invalid_value"
    assert "Invalid value: 'telepathy'" in err["message"] and "'web_search'" in err["message"]
    assert svc.prepared == []  # refused before generation


TENANTS = AppSettings.model_validate({
    "models": [{"id": "m1", "reasoning_parser": "qwen3"}],
    "ingress": {"api_keys": [{"key": "key-a", "tenant": "alice"}, {"key": "key-b", "tenant": "bob"}],
                "tenants": {"alice": {}, "bob": {}}}})


async def test_a_stored_response_is_its_tenants_alone():
    """Another tenant's stored response is not found, as an unknown one, whether it is retrieved, continued or
    deleted (an OpenAI response is its project's alone); its owner keeps it."""
    store = ResponseStoreCore(max_items=100, ttl_s=600)
    app = create_app(IngressContext(settings=TENANTS, service=StubService(), secret=b"s3cret",
                                    response_store=StoreClient(store)))

    def as_(key):
        return openai.AsyncOpenAI(api_key=key, base_url="http://app/v1", max_retries=0,
                                  http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))

    alice, bob = as_("key-a"), as_("key-b")
    first = await alice.responses.create(model="m1", input="alice's plan")
    second = await alice.responses.create(model="m1", input="go on", previous_response_id=first.id)
    assert store.get(first.id)["tenant"] == store.get(second.id)["tenant"] == "alice"
    for rid in (first.id, second.id):
        with pytest.raises(openai.NotFoundError):
            await bob.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError) as e:
            await bob.responses.create(model="m1", input="and then?", previous_response_id=rid)
        assert e.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            await bob.responses.delete(rid)
    assert (await alice.responses.retrieve(second.id)).output_text == "Hello"
    await alice.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        await alice.responses.retrieve(second.id)

    # A record stored before records named their tenant is anyone's until it expires.
    legacy = {k: v for k, v in store.get(first.id).items() if k != "tenant"}
    store.put("resp_legacy", {**legacy, "response": {**legacy["response"], "id": "resp_legacy"}})
    assert (await bob.responses.retrieve("resp_legacy")).id == "resp_legacy"
    third = await bob.responses.create(model="m1", input="next", previous_response_id="resp_legacy")
    assert store.get(third.id)["tenant"] == "bob"


async def test_encrypted_reasoning_is_its_tenants_alone():
    """A tenant's `encrypted_content` is sealed under keys of its own (keyring.for_tenant), as OpenAI binds it to
    the organisation: another tenant sending it back gets the 400 of a blob this server did not seal, and the
    reasoning never reaches that tenant's prompt. One sealed with the server key itself (before tenants had keys
    of their own) still opens for every tenant, so sessions go on across the upgrade."""
    from serve_app.ingress.responses.reasoning_crypto import ReasoningSealer

    svc = StubService()
    app = create_app(IngressContext(settings=TENANTS, service=svc, secret=b"s3cret"))

    def as_(key):
        return openai.AsyncOpenAI(api_key=key, base_url="http://app/v1", max_retries=0,
                                  http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))

    alice, bob = as_("key-a"), as_("key-b")
    r = await alice.responses.create(model="m1", input="q", include=["reasoning.encrypted_content"], store=False,
                                     extra_body={"nvext": {"forced_script": "think_call"}})
    item = r.output[0].model_dump(exclude_none=True)

    def follow(reasoning):
        return [{"role": "user", "content": "q"}, reasoning, r.output[1].model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}]

    await alice.responses.create(model="m1", input=follow(item), store=False)
    assert svc.prepared[-1].conversation.messages[1].parts[0].text == "I should run ls."
    prepared = len(svc.prepared)
    with pytest.raises(openai.BadRequestError) as e:
        await bob.responses.create(model="m1", input=follow(item), store=False)
    assert e.value.body["param"] == "input.1.encrypted_content" and e.value.body["code"] == "invalid_encrypted_content"
    assert len(svc.prepared) == prepared  # refused before anything was rendered
    legacy = {**item, "encrypted_content": ReasoningSealer(b"s3cret").seal("sealed before tenants")}
    for tenant in (alice, bob):
        await tenant.responses.create(model="m1", input=follow(legacy), store=False)
        assert svc.prepared[-1].conversation.messages[1].parts[0].text == "sealed before tenants"
    # Once the operator stops accepting them (ingress.accept_server_key_items), only the tenant's own open.
    strict = TENANTS.model_copy(update={"ingress": TENANTS.ingress.model_copy(
        update={"accept_server_key_items": False})})
    app = create_app(IngressContext(settings=strict, service=svc, secret=b"s3cret"))
    alice = as_("key-a")
    await alice.responses.create(model="m1", input=follow(item), store=False)
    with pytest.raises(openai.BadRequestError) as e:
        await alice.responses.create(model="m1", input=follow(legacy), store=False)
    assert e.value.body["code"] == "invalid_encrypted_content"
