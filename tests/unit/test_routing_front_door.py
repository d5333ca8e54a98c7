"""The front door's routing key (routing/front_door.py) is the ingress's own: for a body of any API, the block
hashes the front door computes from the raw bytes equal the ones the ingress computes for the same request when
it serves it (the real routes over ASGI, the default model's real tokenizer and template), and the ingress
reports the request's load under the front door's id. What the front door cannot read is routed without a key,
never refused."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from starlette.requests import Request
from vllm.distributed.kv_events import KVEventBatch

from serve_app.engine.types import EngineChunk
from serve_app.ingress.context import IngressContext
from serve_app.ingress.server import create_app
from serve_app.routing.front_door import FrontDoor, detect_api
from serve_app.routing.table import RoutingTable
from serve_app.routing.types import ROUTE_ID_HEADER, Decision
from serve_app.service import GenerationService, engine_key
from serve_app.settings import AppSettings, IngressConfig
from tests.support.vllm_blocks import BlockPoolEngine

SECRET = b"unit-test-secret"
BLOCK = 16
SYSTEM = "You are a careful coding agent working in a large repository. " * 30


class RecordingEngines:
    """The ingress's engine client: records what the service routes and reports, answers one token."""

    def __init__(self):
        self.routes, self.prefilled_ids, self.released_ids, self.opened = [], [], [], []

    async def block_size(self, key):
        return BLOCK

    async def reasoning_gate(self, key):
        return False

    async def choose(self, key, req):
        self.routes.append((key, req))
        return Decision("local", "in-process")

    def prefilled(self, key, request_id, cached_tokens=None):
        self.prefilled_ids.append(request_id)

    def release(self, key, request_id, output_tokens=None):
        self.released_ids.append(request_id)

    async def open(self, key, req):
        self.opened.append(req)

        async def chunks():
            yield EngineChunk("ok", [1], finish_reason="stop", num_cached_tokens=0)

        return chunks()


@pytest.fixture(scope="module")
def model_dir() -> str:
    from serve_app.engine.provision import ensure_model

    return ensure_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def settings() -> AppSettings:
    return AppSettings.model_validate({
        "engine_placement": "ingress",
        "router": {"front_door": True},
        "ingress": {"direct_ingress": True},
        "models": [{"id": "smollm2-135m-instruct", "aliases": ["claude-sonnet-4-6", "gpt-5.5"],
                    "max_model_len": 8192, "max_output_tokens": 1024, "tool_parser": "hermes",
                    "chat_template": "serve_app/templates/smollm2_tools.jinja"}],
    })


@pytest.fixture(scope="module")
def door(settings, model_dir) -> FrontDoor:
    d = FrontDoor(settings, SECRET, lambda key: BLOCK)
    d.service._model_paths["smollm2-135m-instruct"] = model_dir
    return d


def served_route(settings, model_dir, path: str, body: dict, headers: dict):
    """What the ingress itself routes for this request: (engine key, RouteRequest) and the load reports."""
    engines = RecordingEngines()
    service = GenerationService(settings, engines, model_paths={"smollm2-135m-instruct": model_dir})
    app = create_app(IngressContext(settings=settings, service=service, secret=SECRET))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body, headers=headers)

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    assert len(engines.routes) == 1
    return engines


def hook_request(headers: dict) -> Request:
    """The hook's own HTTP request as the Router receives it (HAProxy forwards the session and request ids)."""
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/internal/route", "headers": raw})


BASH_CHAT = {"type": "function", "function": {"name": "Bash", "description": "Run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
BASH_ANTHROPIC = {"name": "Bash", "description": "Run a command", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
BASH_RESPONSES = {"type": "function", "name": "Bash", "description": "Run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}

CASES = {
    "chat tool loop": ("/v1/chat/completions", "chat", {
        "model": "gpt-5.5", "max_tokens": 50, "tools": [BASH_CHAT], "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "List the files, then say \"done\" — ünïcode 🚀"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "Bash", "arguments": json.dumps({"command": "ls -la \"a b\"\n"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
        ]}),
    "messages tool loop": ("/v1/messages", "messages", {
        "model": "claude-sonnet-4-6", "max_tokens": 50, "tools": [BASH_ANTHROPIC],
        "system": [{"type": "text", "text": SYSTEM}], "messages": [
            {"role": "user", "content": "List the files."},
            {"role": "assistant", "content": [{"type": "text", "text": "Listing."}, {
                "type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"}]},
        ]}),
    # Neither a system field nor an Anthropic-only block: read as Chat, and the prompt is the same.
    "messages plain text": ("/v1/messages", "chat", {
        "model": "claude-sonnet-4-6", "max_tokens": 20, "metadata": {"user_id": "user_abc_session_1234"},
        "messages": [{"role": "user", "content": SYSTEM + " What next?"}]}),
    "responses items": ("/v1/responses", "responses", {
        "model": "gpt-5.5", "instructions": SYSTEM, "tools": [BASH_RESPONSES], "store": False,
        "prompt_cache_key": "conv-42", "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "function_call", "call_id": "call_1", "name": "Bash", "arguments": "{\"command\": \"ls\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
        ]}),
    "responses string": ("/v1/responses", "responses", {
        "model": "gpt-5.5", "input": SYSTEM + " Summarise.", "store": False, "max_output_tokens": 64}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_front_door_keys_a_body_as_the_ingress_routes_it(name, settings, model_dir, door):
    path, api, body = CASES[name]
    route_id = f"router-1/front-{name.replace(' ', '-')}"
    headers = {"x-request-id": "from-haproxy", "x-session-id": "sess-1", ROUTE_ID_HEADER: route_id}
    engines = served_route(settings, model_dir, path, body, headers)
    key, served = engines.routes[0]

    routed = asyncio.run(door.route_request(json.dumps(body).encode(), hook_request(headers), route_id,
                                            headers["x-session-id"]))
    assert routed.api == api and routed.why_unkeyed is None
    assert routed.engine_key == key
    got = routed.request
    assert len(got.block_hashes) >= 3, "the case must span several blocks"
    assert got.block_hashes == served.block_hashes
    assert got.num_prompt_tokens == served.num_prompt_tokens
    assert got.expected_output_tokens == served.expected_output_tokens
    # The ingress keeps the Router's load for this request under the front door's route id, not its own.
    assert served.request_id == route_id
    assert engines.prefilled_ids == [route_id] and engines.released_ids == [route_id]


def test_without_the_front_door_the_ingress_keeps_its_own_request_ids(model_dir):
    settings = AppSettings.model_validate({"models": [{"id": "m", "source": "smollm2-135m-instruct",
                                                        "chat_template": "serve_app/templates/smollm2_tools.jinja"}]})
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    engines = RecordingEngines()
    service = GenerationService(settings, engines, model_paths={"smollm2-135m-instruct": model_dir})
    app = create_app(IngressContext(settings=settings, service=service, secret=SECRET))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/chat/completions", json=body,
                                headers={"x-request-id": "client-chosen", ROUTE_ID_HEADER: "r/client-chosen"})

    assert asyncio.run(go()).status_code == 200
    # Without the front door no header names the request's routing or engine work.
    assert engines.routes[0][1].request_id not in ("client-chosen", "r/client-chosen")


def test_a_longer_history_extends_the_same_prefix(door):
    """Turn k+1 of a session hashes to turn k's blocks plus more: what lets the Router send it where turn k ran."""
    path, _, body = CASES["chat tool loop"]
    longer = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "Two files."},
                                   {"role": "user", "content": "Now open a.py and read it " * 20}]}

    def hashes(b):
        r = asyncio.run(door.route_request(json.dumps(b).encode(), hook_request({}), "id"))
        return r.request.block_hashes

    short, long_ = hashes(body), hashes(longer)
    assert len(long_) > len(short)
    # All but the last full block of the shorter prompt (its end-of-turn tokens may render differently).
    assert long_[: len(short) - 1] == short[: len(short) - 1]


# ---- tenants: the front door never sees the key, so it finds the namespace a prompt is cached under ----

TWO_TENANTS = {"direct_ingress": True, "api_keys": [{"key": "key-a", "tenant": "alice"},
                                                    {"key": "key-b", "tenant": "bob"}],
               "tenants": {"alice": {}, "bob": {}}}


def with_ingress(settings: AppSettings, ingress: dict) -> AppSettings:
    return settings.model_copy(update={"ingress": IngressConfig.model_validate(ingress)})


def table_holding(settings: AppSettings, key: str, held: dict[str, list]) -> RoutingTable:
    """A Router's table whose replicas have each served these engine requests, indexed from the KV events vLLM's
    own block pool publishes as it caches their prompts under their tenants' salts."""
    table = RoutingTable(settings.router)
    core = table.core(key, BLOCK)
    core.sync_replicas(list(held))
    for rid, reqs in held.items():
        engine = BlockPoolEngine(BLOCK, num_blocks=1024)
        for seq, req in enumerate(reqs):
            _, events = engine.run(req.prompt_token_ids, req.cache_salt)
            table.feeds[key].apply(rid, KVEventBatch(ts=0.0, events=events), seq=seq)
    return table


def tenant_door(settings, model_dir, table: RoutingTable) -> FrontDoor:
    d = FrontDoor(settings, SECRET, lambda key: BLOCK, held_prefix=table.held_prefix)
    d.service._model_paths["smollm2-135m-instruct"] = model_dir
    return d


def turns_of(body: dict, n: int) -> list[dict]:
    """A Chat session's first `n` requests: each resends the whole history and adds a tool output."""
    out, messages = [], list(body["messages"][:2])
    for t in range(n):
        out.append({**body, "messages": list(messages)})
        messages += [{"role": "assistant", "content": f"Step {t} done."},
                     {"role": "user", "content": f"Tool output {t}: " + "lines of a listing " * 12}]
    return out


def test_each_tenants_prompt_is_keyed_in_its_own_cache_namespace(settings, model_dir):
    """HAProxy forwards no API key, yet a tenant's later turn is keyed exactly as the ingress keys it (its
    tenant's salt) and goes to the replica holding its history, even when another tenant's copy of the shared
    system prompt sits on the other replica."""
    cfg = with_ingress(settings, TWO_TENANTS)
    key = engine_key(cfg.models[0])
    path, _, body = CASES["chat tool loop"]
    first, second, third = turns_of(body, 3)

    def served(b, api_key):
        engines = served_route(cfg, model_dir, path, b, {"x-api-key": api_key})
        return engines.routes[0][1], engines.opened[0]

    (_, alice_first), (_, bob_first), (_, bob_second) = (served(first, "key-a"), served(first, "key-b"),
                                                         served(second, "key-b"))
    assert alice_first.cache_salt != bob_first.cache_salt  # two namespaces: the same prompt is cached twice
    bob_third, _ = served(third, "key-b")

    table = table_holding(cfg, key, {"r-alice": [alice_first], "r-bob": [bob_first, bob_second]})
    door = tenant_door(cfg, model_dir, table)
    routed = asyncio.run(door.route_request(json.dumps(third).encode(), hook_request({}), "r/1"))
    assert routed.request.block_hashes == bob_third.block_hashes
    decision = table.choose(key, routed.request)
    assert decision.replica_id == "r-bob" and decision.cached_blocks >= len(bob_second.prompt_token_ids) // BLOCK
    assert door.namespace_ties == 0

    # A first turn both tenants have cached is a tie: the earliest namespace is taken, and the tie is counted.
    tied = asyncio.run(door.route_request(json.dumps(first).encode(), hook_request({}), "r/2"))
    alice_key, _ = served(first, "key-a")
    assert tied.request.block_hashes == alice_key.block_hashes and door.namespace_ties == 1

    # A later turn decided by its own history tells whose namespace its user's is: that user's next first turn
    # (a new session) takes it; another user's still takes the earliest.
    def as_user(b, user):
        return json.dumps({**b, "safety_identifier": user}).encode()

    asyncio.run(door.route_request(as_user(third, "dev-7"), hook_request({}), "r/3"))
    mine = asyncio.run(door.route_request(as_user(first, "dev-7"), hook_request({}), "r/4"))
    assert mine.request.block_hashes == served(first, "key-b")[0].block_hashes
    assert door.namespace_ties == 2 and door.namespace_ties_by_user == 1
    theirs = asyncio.run(door.route_request(as_user(first, "dev-8"), hook_request({}), "r/5"))
    assert theirs.request.block_hashes == alice_key.block_hashes and door.namespace_ties_by_user == 1
    # A first turn decides nothing about its user, even where only one namespace holds it (another tenant's
    # copy of a shared prompt is no sign of whose the user is).
    door._user_namespaces.clear()
    only_bob = tenant_door(cfg, model_dir, table_holding(cfg, key, {"r-bob": [bob_first]}))
    asyncio.run(only_bob.route_request(as_user(first, "dev-9"), hook_request({}), "r/6"))
    assert not only_bob._user_namespaces


def test_a_prompt_no_replica_holds_and_a_single_namespace_are_keyed_without_a_probe(settings, model_dir):
    path, _, body = CASES["chat tool loop"]
    # One keyed tenant: its namespace is the only one a request can be served under, so it is exact.
    only_bob = with_ingress(settings, {**TWO_TENANTS, "api_keys": [{"key": "key-b", "tenant": "bob"}]})
    probed = []
    door = FrontDoor(only_bob, SECRET, lambda key: BLOCK, held_prefix=lambda key, h: probed.append(h) or 0)
    door.service._model_paths["smollm2-135m-instruct"] = model_dir
    routed = asyncio.run(door.route_request(json.dumps(body).encode(), hook_request({}), "r/1"))
    served = served_route(only_bob, model_dir, path, body, {"x-api-key": "key-b"}).routes[0][1]
    assert routed.request.block_hashes == served.block_hashes and probed == []

    # Several namespaces, nothing cached anywhere: one first-block probe each, the first namespace's hashes.
    cfg = with_ingress(settings, TWO_TENANTS)
    door = FrontDoor(cfg, SECRET, lambda key: BLOCK, held_prefix=lambda key, h: probed.append(h) or 0)
    door.service._model_paths["smollm2-135m-instruct"] = model_dir
    routed = asyncio.run(door.route_request(json.dumps(body).encode(), hook_request({}), "r/2"))
    alice = served_route(cfg, model_dir, path, body, {"x-api-key": "key-a"}).routes[0][1]
    assert routed.request.block_hashes == alice.block_hashes
    assert [len(h) for h in probed] == [1, 1] and door.namespace_ties == 0


@pytest.mark.parametrize("raw, why", [
    (b"", "JSON"),
    (b"{\"model\": \"gpt-5.5\", \"messages\": [", "not JSON"),  # cut off by the front door's buffer
    (b"\x1f\x8b\x08\x00compressed", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps({"model": "gpt-5.5", "messages": "not a list"}).encode(), ""),  # the ingress answers the 400
])
def test_a_body_the_front_door_cannot_read_is_routed_without_a_key(door, raw, why):
    routed = asyncio.run(door.route_request(raw, hook_request({}), "r1", "sess"))
    assert routed.request.block_hashes == [] and routed.why_unkeyed and why in routed.why_unkeyed
    assert routed.request.request_id == "r1" and routed.request.session_key == "sess"


def test_unknown_models_and_stored_histories_are_routed_by_load_and_session(door, settings):
    unknown = asyncio.run(door.route_request(json.dumps({"model": "nope", "messages": [
        {"role": "user", "content": "hi"}]}).encode(), hook_request({}), "r2"))
    assert unknown.engine_key is None and unknown.request.block_hashes == []

    # A door built without the Responses store (an app without one) cannot see a continuation's history.
    stored = asyncio.run(door.route_request(json.dumps({"model": "gpt-5.5", "input": "next",
                                                        "previous_response_id": "resp_1"}).encode(),
                                            hook_request({}), "r3", "conv-7"))
    assert stored.engine_key == engine_key(settings.models[0]) and stored.request.block_hashes == []
    assert stored.request.session_key == "conv-7" and "Responses store" in stored.why_unkeyed


# ---- a Responses continuation: its history read from the store the ingress uses ----

def test_the_front_door_opens_any_tenants_encrypted_reasoning_to_route_it(settings, model_dir):
    """Encrypted reasoning is sealed with its tenant's keys (keyring.for_tenant) and the front door sees no key:
    it opens whichever configured tenant's it is, to render the prompt the ingress will (the ingress then checks
    it is the sender's own). One no configured tenant's keys sealed is routed without a key."""
    from serve_app.ingress.responses.reasoning_crypto import ReasoningSealer
    from serve_app.keyring import for_tenant

    settings = with_ingress(settings, TWO_TENANTS)
    door = FrontDoor(settings, SECRET, lambda key: BLOCK)
    door.service._model_paths["smollm2-135m-instruct"] = model_dir

    def body(tenant: str) -> dict:
        sealed = ReasoningSealer(for_tenant(SECRET, tenant)).seal("The listing comes first.")
        return {"model": "gpt-5.5", "instructions": SYSTEM, "tools": [BASH_RESPONSES], "max_output_tokens": 20,
                "store": False, "input": [
                    {"role": "user", "content": "List the files."},
                    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": sealed},
                    {"type": "function_call", "call_id": "call_1", "name": "Bash", "arguments": '{"command": "ls"}'},
                    {"type": "function_call_output", "call_id": "call_1", "output": "a.txt"}]}

    for tenant, key in (("alice", "key-a"), ("bob", "key-b")):
        routed = asyncio.run(door.route_request(json.dumps(body(tenant)).encode(), hook_request({}), f"r-{tenant}"))
        assert routed.why_unkeyed is None, routed.why_unkeyed
        served = served_route(settings, model_dir, "/v1/responses", body(tenant), {"authorization": f"Bearer {key}"})
        assert routed.request.num_prompt_tokens == served.routes[0][1].num_prompt_tokens
    stranger = asyncio.run(door.route_request(json.dumps(body("mallory")).encode(), hook_request({}), "r-m"))
    assert stranger.request.block_hashes == [] and "encrypted_content" in stranger.why_unkeyed


def store_door(settings, model_dir, store, budget_s: float = 5.0) -> FrontDoor:
    from serve_app.ingress.responses.store import StoreClient
    from serve_app.routing.front_door import HistoryReader

    client = StoreClient(store, recent_bytes=settings.ingress.response_store_recent_bytes)  # as the deployment's
    d = FrontDoor(settings, SECRET, lambda key: BLOCK, HistoryReader(client, budget_s))
    d.service._model_paths["smollm2-135m-instruct"] = model_dir
    return d


def serve_with_store(settings, model_dir, store, body: dict, headers: dict | None = None):
    """One Responses request through the ingress's real routes with `store`: (engines, response JSON)."""
    from serve_app.ingress.responses.store import StoreClient

    engines = RecordingEngines()
    service = GenerationService(settings, engines, model_paths={"smollm2-135m-instruct": model_dir})
    app = create_app(IngressContext(settings=settings, service=service, secret=SECRET,
                                    response_store=StoreClient(store)))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post("/v1/responses", json=body, headers=headers or {})

    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    return engines, r.json()


@pytest.mark.parametrize("tenant", ["default", "bob"])
def test_a_responses_continuation_is_keyed_by_its_stored_history(settings, model_dir, tenant):
    """`previous_response_id`: the front door reads the chain from the store the ingress uses and keys the
    continuation by its whole prompt — the same hashes the ingress routes it by, extending the turns before it,
    so it goes where they ran. A named tenant's stored responses are its own, but the front door, which sees no
    key, reads them to route (the ingress checks the owner)."""
    from serve_app.ingress.responses.store import ResponseStoreCore

    key = {}
    if tenant != "default":  # bob's keys only: one namespace, so the front door's hashes are exact
        settings = with_ingress(settings, {**TWO_TENANTS, "api_keys": [{"key": "key-b", "tenant": "bob"}]})
        key = {"x-api-key": "key-b"}
    store = ResponseStoreCore(max_items=100, ttl_s=600)
    door = store_door(settings, model_dir, store)
    turn = {"model": "gpt-5.5", "instructions": SYSTEM, "tools": [BASH_RESPONSES], "max_output_tokens": 20,
            "input": "List the files."}
    engines, first = serve_with_store(settings, model_dir, store, turn, key)
    assert store.get(first["id"])["tenant"] == tenant
    first_hashes = engines.routes[0][1].block_hashes
    previous, chain_hashes = first["id"], [first_hashes]
    for n in range(2):  # two continuations: the second's history is a chain of two stored turns
        body = {"model": "gpt-5.5", "instructions": SYSTEM, "tools": [BASH_RESPONSES], "max_output_tokens": 20,
                "previous_response_id": previous, "input": f"And now step {n}: " + "read the file " * 10}
        headers = {ROUTE_ID_HEADER: f"router-1/cont-{n}"}
        routed = asyncio.run(door.route_request(json.dumps(body).encode(), hook_request(headers),
                                                f"router-1/cont-{n}"))
        engines, answer = serve_with_store(settings, model_dir, store, body, {**headers, **key})
        served = engines.routes[0][1]
        assert routed.api == "responses" and routed.why_unkeyed is None, routed.why_unkeyed
        assert routed.request.block_hashes == served.block_hashes
        assert routed.request.num_prompt_tokens == served.num_prompt_tokens
        # Every earlier turn's full blocks but its last (its end-of-turn tokens may render differently).
        for earlier in chain_hashes:
            assert routed.request.block_hashes[: len(earlier) - 1] == earlier[: len(earlier) - 1]
        assert len(routed.request.block_hashes) > len(chain_hashes[-1])
        chain_hashes.append(served.block_hashes)
        previous = answer["id"]
    assert door.keyed == 2 and door.unkeyed == 0
    # Each continuation's chain but its newest record came from the records the Router read before.
    assert door.ctx.response_store.store.recent.extended == 2


def test_a_continuation_whose_history_is_missing_or_slow_is_routed_without_a_key(settings, model_dir):
    from serve_app.ingress.responses.store import ResponseStoreCore

    body = json.dumps({"model": "gpt-5.5", "input": "next", "previous_response_id": "resp_gone"}).encode()
    gone = asyncio.run(store_door(settings, model_dir, ResponseStoreCore()).route_request(
        body, hook_request({}), "r4", "conv-8"))
    assert gone.request.block_hashes == [] and "no stored response with id 'resp_gone'" in gone.why_unkeyed
    assert gone.request.session_key == "conv-8" and gone.engine_key is not None

    class StuckStore(ResponseStoreCore):
        async def chain(self, key, links=False):  # a database that stopped answering
            await asyncio.sleep(60)

        head = chain

    async def route_stuck():
        door = store_door(settings, model_dir, StuckStore(), budget_s=0.2)
        return await asyncio.wait_for(door.route_request(body, hook_request({}), "r5"), 30)

    stuck = asyncio.run(route_stuck())
    assert stuck.request.block_hashes == [] and "did not answer within 0.2 s" in stuck.why_unkeyed


def test_before_any_replica_registered_there_is_no_block_size_to_hash_with(settings, model_dir):
    d = FrontDoor(settings, SECRET, lambda key: None)
    d.service._model_paths["smollm2-135m-instruct"] = model_dir
    routed = asyncio.run(d.route_request(json.dumps(CASES["chat tool loop"][2]).encode(), hook_request({}), "r"))
    assert routed.engine_key is not None and routed.request.block_hashes == []
    assert routed.request.num_prompt_tokens > 0


@pytest.mark.parametrize("body, api", [
    ({"input": "x"}, "responses"),
    ({"instructions": "x", "model": "m"}, "responses"),
    ({"system": "x", "messages": []}, "messages"),
    ({"messages": [], "tools": [{"name": "t", "input_schema": {}}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "x"}]}]}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "chat"),
    ({"messages": [{"role": "assistant", "tool_calls": []}]}, "chat"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "chat"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, "chat"),
])
def test_the_api_is_told_by_the_body_shape(body, api):
    assert detect_api(body) == api


# ---- the ingress's reports and the Router replica's share of them (no Ray) ----

class FakeCall:
    def __init__(self):
        self.calls = []

    def remote(self, *args, **kwargs):
        self.calls.append((*args, *kwargs.values()))

        async def answer():
            return None

        return answer()


class RouterHandle:
    """The Router's handle as the ingress uses it: every call recorded."""

    def __init__(self):
        self.register_replica, self.prefilled, self.released = FakeCall(), FakeCall(), FakeCall()
        self.abandoned, self.unrouted = FakeCall(), FakeCall()


def test_the_ingress_registers_its_engines_and_reports_what_a_router_placed():
    from serve_app.engine.local_client import LocalEngineClient

    class Engine:
        kv_events_port, kv_replay_port, block_size, dead = 5551, 5552, 128, False

    router = RouterHandle()
    client = LocalEngineClient({"Engine-a": Engine()}, replica_id="ing-1")

    async def run():
        client.report_to(router, "10.0.0.7")
        await asyncio.sleep(0.01)
        client.prefilled("Engine-a", "rtr-2/req-9", 64)
        client.release("Engine-a", "rtr-2/req-9", 7)
        client.prefilled("Engine-a", "4f2c9d", 0)  # the ingress's own id: no Router placed it, nothing reserved
        client.release("Engine-a", "4f2c9d", 1)
        await asyncio.sleep(0.01)
        client.shutdown()

    asyncio.run(run())
    assert router.register_replica.calls[0] == ("Engine-a", "ing-1", "tcp://10.0.0.7:5551", "tcp://10.0.0.7:5552",
                                                 128, False, {})
    assert router.prefilled.calls == [("Engine-a", "rtr-2/req-9", 64)]
    assert router.released.calls == [("Engine-a", "rtr-2/req-9", 7)]


def test_a_router_replica_applies_only_the_reports_of_requests_it_placed():
    """With several front-door Router replicas (one per proxy node) a report may reach another one: it must not
    release a reservation of the same request id there."""
    from serve_app.routing.front_door_deployment import FrontDoorRouter
    from serve_app.routing.table import RoutingTable
    from serve_app.routing.types import RouteRequest
    from serve_app.settings import RouterConfig

    def replica(rid):
        r = FrontDoorRouter.func_or_class.__new__(FrontDoorRouter.func_or_class)
        r.table, r.replica_id = RoutingTable(RouterConfig(), kv_events=False), rid
        r.table.sync_replicas("Engine-a", ["ing-1"])
        return r

    a, b = replica("rtr-a"), replica("rtr-b")
    for r in (a, b):
        r.table.choose("Engine-a", RouteRequest(request_id=f"{r.replica_id}/req-1"))
    asyncio.run(b.released("Engine-a", "rtr-a/req-1", 5))  # a's report reaching b
    asyncio.run(b.released("Engine-a", "rtr-a/req-1", 5))
    assert b.table.cores["Engine-a"].loads["ing-1"].active_requests == 1
    asyncio.run(a.prefilled("Engine-a", "rtr-a/req-1", 0))
    asyncio.run(a.released("Engine-a", "rtr-a/req-1", 5))
    assert a.table.cores["Engine-a"].loads["ing-1"].active_requests == 0


def test_each_registration_lists_the_placed_requests_the_ingress_runs_now(monkeypatch):
    """What a Router replica reconciles its reservations with when the reports went to another one."""
    from serve_app.engine import local_client
    from serve_app.engine.local_client import LocalEngineClient
    from serve_app.routing.types import RouteRequest

    monkeypatch.setattr(local_client, "REGISTER_EVERY_S", 0.02)

    class Engine:
        kv_events_port, kv_replay_port, block_size, dead = 5551, None, 128, False

    router = RouterHandle()
    client = LocalEngineClient({"Engine-a": Engine()}, replica_id="ing-1")

    async def latest_running():
        n = len(router.register_replica.calls)
        while len(router.register_replica.calls) == n:
            await asyncio.sleep(0.005)
        return router.register_replica.calls[-1][-1]

    async def run():
        client.report_to(router, "10.0.0.7")
        assert await latest_running() == {}
        for rid in ("rtr-a/r1", "rtr-b/r2", "own-id"):  # the last one no Router placed: never listed
            await client.choose("Engine-a", RouteRequest(request_id=rid))
        assert await latest_running() == {"rtr-a/r1": False, "rtr-b/r2": False}
        client.prefilled("Engine-a", "rtr-b/r2", 0)
        assert await latest_running() == {"rtr-a/r1": False, "rtr-b/r2": True}
        client.release("Engine-a", "rtr-a/r1", 3)
        client.release("Engine-a", "own-id", 3)
        assert await latest_running() == {"rtr-b/r2": True}
        client.shutdown()

    asyncio.run(run())


def test_a_router_replica_releases_its_reservations_the_ingress_no_longer_runs(monkeypatch):
    """Several front-door Router replicas: a's end report went to b, so a learns the end from the ingress's next
    registration instead of holding the reservation until it expires (900 s)."""
    from serve_app.routing import front_door_deployment
    from serve_app.routing.front_door_deployment import FrontDoorRouter
    from serve_app.routing.table import RoutingTable
    from serve_app.routing.types import RouteRequest
    from serve_app.settings import RouterConfig

    def replica(rid):
        r = FrontDoorRouter.func_or_class.__new__(FrontDoorRouter.func_or_class)
        r.table, r.replica_id = RoutingTable(RouterConfig(), kv_events=False), rid
        r.table.register_replica("Engine-a", "ing-1", None, None, 16)
        r.table.register_replica("Engine-a", "ing-2", None, None, 16)
        r.table.sync_replicas("Engine-a", ["ing-1", "ing-2"])
        return r

    def req(rid, n=64):
        return RouteRequest(request_id=rid, block_hashes=list(range(n // 16)), num_prompt_tokens=n,
                            expected_output_tokens=8)

    a = replica("rtr-a")
    core = a.table.cores["Engine-a"]
    assert a.table.choose("Engine-a", req("rtr-a/r0")) is not None  # a decision reserves (what is reconciled)
    a.table.release("Engine-a", "rtr-a/r0")
    placed = {"rtr-a/r1": "ing-1", "rtr-a/r2": "ing-1", "rtr-a/r3": "ing-1", "rtr-a/r4": "ing-2",
              # another Router replica's id, as if a retried id had landed here: not a's to release
              "rtr-b/r9": "ing-1"}
    for rid, ing in placed.items():
        core._reserve(req(rid), ing, 64, core.now())
    on_1 = ["rtr-a/r1", "rtr-a/r2", "rtr-a/r3"]
    active = lambda ing: core.loads[ing].active_requests  # noqa: E731
    before = {ing: active(ing) for ing in ("ing-1", "ing-2")}
    registration = ("Engine-a", "ing-1", None, None, 16)

    # Younger than RECONCILE_AFTER_S: the request may still be on its way to the ingress, nothing is released.
    asyncio.run(a.register_replica(*registration, refresh=True, running={}))
    assert {ing: active(ing) for ing in ("ing-1", "ing-2")} == before

    monkeypatch.setattr(front_door_deployment, "RECONCILE_AFTER_S", -1.0)
    still, *ended = on_1
    asyncio.run(a.register_replica(*registration, refresh=True, running={still: True, "rtr-b/r9": False}))
    assert active("ing-1") == before["ing-1"] - len(ended)
    assert active("ing-2") == before["ing-2"]  # another ingress's reservations are its own registration's business
    assert core._inflight[still].prefilled and core._inflight[still].prefill == 0
    assert "rtr-b/r9" in core._inflight
    assert core.rates["ing-1"].prefill.samples == 0  # learnt late: not a measurement of the replica
    assert core.reconciled_reservations == len(ended)

    # Its own end report arriving afterwards changes nothing more; nor does a registration without `running`.
    for rid in ended:
        asyncio.run(a.released("Engine-a", rid, 5))
    asyncio.run(a.register_replica(*registration, refresh=True))
    assert active("ing-1") == before["ing-1"] - len(ended)
    asyncio.run(a.register_replica(*registration, refresh=True, running={}))
    assert active("ing-1") == 1 and "rtr-b/r9" in core._inflight  # only b's is left on ing-1


class ReplicaId:
    def __init__(self, unique_id):
        self.unique_id = unique_id

    def to_full_id_str(self):
        return f"SERVE_REPLICA::default#Ingress#{self.unique_id}"


class HookIngress:
    """Serve's handle to the Ingress deployment as the Router's hook uses it: the target if it is alive, else its
    own choice (ing-2); `delay`: how long the choice takes."""

    def __init__(self, live, delay: float = 0.0):
        self.live, self.delay = live, delay

    @contextlib.asynccontextmanager
    async def choose_replica(self, target, _reserve):
        await asyncio.sleep(self.delay)
        rid = target.target_replica if target.target_replica in self.live else "ing-2"
        replica = type("Replica", (), {"replica_id": ReplicaId(rid), "backend_http_endpoint": ("10.0.0.7", 8)})
        yield type("Selection", (), {"_replica": replica})()


class HookDoor:
    """The Router's FrontDoor: `keyed_body` is a 32-token request for Engine-a, anything else has no key."""
    keyed = unkeyed = 0

    def __init__(self, keyed_body):
        self.keyed_body = keyed_body

    async def route_request(self, body, request, route_id, session_id):
        from serve_app.routing.front_door import Routed
        from serve_app.routing.types import RouteRequest

        if body != self.keyed_body:
            return Routed(None, RouteRequest(request_id=route_id))
        return Routed("Engine-a", RouteRequest(request_id=route_id, block_hashes=[1, 2], num_prompt_tokens=32,
                                               expected_output_tokens=8))


def hook_call(body: bytes, request_id: str) -> Request:
    """HAProxy's call of the hook: the client's body and the x-request-id HAProxy set."""
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}
    return Request({"type": "http", "method": "POST", "path": "/internal/route", "query_string": b"",
                    "headers": [(b"x-request-id", request_id.encode())]}, receive)


def hook_router(policy: str = "kv", live=("ing-1",), delay: float = 0.0, timeout_s: float = 5.0):
    """A front-door Router replica (`rtr`) without Serve: one engine, Engine-a, on ing-1."""
    from serve_app.routing.front_door_deployment import FrontDoorRouter
    from serve_app.routing.table import RoutingTable
    from serve_app.settings import RouterConfig

    router = FrontDoorRouter.func_or_class.__new__(FrontDoorRouter.func_or_class)
    router.table, router.replica_id, router.route_ms = RoutingTable(RouterConfig(policy=policy), kv_events=False), "rtr", 0.0
    router.decisions = router.fallbacks = router.late = router.abandoned_requests = router.pin_misses = 0
    router.timeout_s = timeout_s
    router.door, router._ingress = HookDoor(b"keyed"), HookIngress(set(live), delay)
    router.table.register_replica("Engine-a", "ing-1", None, None, 16)
    router.table.sync_replicas("Engine-a", ["ing-1"])
    return router


def test_each_front_door_answer_is_counted_for_the_routing_panel():
    """`router_decisions_total` (the dashboard's routing panel) counts the front door's answers as the ingress counts
    the Engine placement's: a decision by its policy and whether the chosen replica holds the prefix; a body with no
    key, or a chosen replica that has gone, as Serve's fallback."""
    from serve_app import metrics

    request = hook_call
    router = hook_router()

    def count(policy, outcome):
        return metrics.REGISTRY.get_sample_value(metrics.PREFIX + "router_decisions_total",
                                                 {"policy": policy, "outcome": outcome}) or 0.0

    labels = [("kv", "cache_miss"), ("kv", "cache_hit"), ("fallback", "no_decision"), ("fallback", "replica_gone")]
    before = {k: count(*k) for k in labels}
    answers = [json.loads(asyncio.run(router.route(request(body, rid))).body)
               for body, rid in ((b"keyed", "r1"), (b"not json", "r2"))]
    router.table.mark_prefilled("Engine-a", "rtr/r1", 0)  # r1's prefix is now on ing-1
    answers.append(json.loads(asyncio.run(router.route(request(b"keyed", "r3"))).body))
    router._ingress.live = set()  # ing-1 goes before r4 is forwarded: Serve picks another
    answers.append(json.loads(asyncio.run(router.route(request(b"keyed", "r4"))).body))

    assert [a["replica_id"].rsplit("#", 1)[1] for a in answers] == ["ing-1", "ing-2", "ing-1", "ing-2"]
    # A decision's route id; an empty one where nothing was reserved (not a pin-miss when it arrives without one).
    assert [a["request_headers"][ROUTE_ID_HEADER] for a in answers] == ["rtr/r1", "", "rtr/r3", ""]
    assert {k: count(*k) - before[k] for k in labels} == {k: 1 for k in labels}
    assert (router.decisions, router.fallbacks) == (2, 2)


# ---- answers that go unused: the reservation is released at once, not at reconcile ----

def active(router) -> int:
    return router.table.cores["Engine-a"].loads["ing-1"].active_requests


def test_an_answer_later_than_haproxy_waits_releases_its_reservation():
    """HAProxy stops waiting for the hook after its timeout and answers 503 itself: nothing will be forwarded."""
    router = hook_router(delay=0.05, timeout_s=0.01)
    answer = asyncio.run(router.route(hook_call(b"keyed", "r1")))
    assert answer.status_code == 200
    assert active(router) == 0 and not router.table.cores["Engine-a"]._inflight
    assert router.late == 1

    on_time = hook_router(delay=0.0, timeout_s=5.0)
    asyncio.run(on_time.route(hook_call(b"keyed", "r1")))
    assert active(on_time) == 1 and on_time.late == 0  # forwarded: its ingress reports its end


def test_a_cancelled_hook_call_releases_its_reservation():
    router = hook_router(delay=60.0)

    async def run():
        task = asyncio.create_task(router.route(hook_call(b"keyed", "r1")))
        while not router.table.cores.get("Engine-a") or not router.table.cores["Engine-a"]._inflight:
            await asyncio.sleep(0.001)
        assert active(router) == 1  # reserved while the replica is being chosen
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert active(router) == 0


def test_a_request_the_ingress_never_ran_or_received_unrouted_is_released_in_its_router(monkeypatch):
    """`abandoned`: the ingress got the route id but no engine stream took it (count_tokens, an error first).
    `unrouted`: it arrived without its route id (a pin-miss through Serve's fallback proxy), by x-request-id."""
    from serve_app import metrics

    counted = []
    monkeypatch.setattr(metrics, "observe_router_decision", lambda *labels: counted.append(labels))
    router = hook_router()
    for rid in ("r1", "r2", "r3"):
        asyncio.run(router.route(hook_call(b"keyed", rid)))
    assert active(router) == 3 and (router.decisions, router.fallbacks) == (3, 0)

    asyncio.run(router.abandoned("rtr/r1"))
    asyncio.run(router.abandoned("other-rtr/r2"))  # another Router replica's id: not this one's to release
    assert active(router) == 2 and router.abandoned_requests == 1
    asyncio.run(router.unrouted("r2"))
    assert active(router) == 1 and router.pin_misses == 1
    assert (router.decisions, router.fallbacks) == (2, 1)  # the pin-miss was placed by Serve's fallback
    asyncio.run(router.unrouted("never-placed"))  # before HAProxy knew the Router, or no key: nothing reserved
    asyncio.run(router.abandoned("rtr/r1"))  # a repeat changes nothing
    assert active(router) == 1 and (router.pin_misses, router.abandoned_requests) == (1, 1)
    assert router.table.cores["Engine-a"].rates["ing-1"].prefill.samples == 0  # none of it measured the replica
    # Nor did it leave a cache footprint there: r1 prefilled the prompt r2 and r3 were placed to find, and the
    # one still running (r3) prefilled nothing, so nothing counts where new prompts are placed.
    core = router.table.cores["Engine-a"]
    assert core.loads["ing-1"].recent(core.now()) == 0 and core.loads["ing-1"].routed == 1
    # The Prometheus counter cannot un-count the pin-missed decision: it gets one `pin_miss` sample to subtract.
    assert counted.count(("fallback", "pin_miss")) == 1 and len(counted) == 4, counted


class SessionsDoor(HookDoor):
    """Each body a new 32-token prompt of its own (block hashes from the body)."""

    async def route_request(self, body, request, route_id, session_id):
        from serve_app.routing.front_door import Routed
        from serve_app.routing.types import RouteRequest

        hashes = [hash((body, i)) for i in range(2)]
        return Routed("Engine-a", RouteRequest(request_id=route_id, block_hashes=hashes, num_prompt_tokens=32,
                                               expected_output_tokens=8))


def test_a_new_session_delivered_elsewhere_does_not_steer_the_next_one_away():
    """Right after a deploy Serve's handle may not list a replica the Router already has (its engine
    registered first): the first new session, placed there, goes to the other one. Its prefill happened there,
    so the next new session is placed on the replica that has prefilled nothing; otherwise both sessions pile
    onto one replica while the other sits idle (their later turns follow their prefixes)."""
    router = hook_router(live=("ing-2",))
    router.door = SessionsDoor(None)
    router.table.register_replica("Engine-a", "ing-2", None, None, 16)
    router.table.sync_replicas("Engine-a", ["ing-1", "ing-2"])
    first = json.loads(asyncio.run(router.route(hook_call(b"session one", "r1"))).body)
    # Its reservation went with it: ing-2 reports its prefill and end under the route id.
    assert first["replica_id"].endswith("#ing-2") and first["request_headers"][ROUTE_ID_HEADER] == "rtr/r1"
    assert (router.decisions, router.fallbacks) == (0, 1)
    loads = router.table.cores["Engine-a"].loads
    assert (loads["ing-1"].active_requests, loads["ing-2"].active_requests) == (0, 1)
    router._ingress.live = {"ing-1", "ing-2"}  # Serve's handle catches up
    second = json.loads(asyncio.run(router.route(hook_call(b"session two", "r2"))).body)
    assert second["replica_id"].endswith("#ing-1") and second["request_headers"][ROUTE_ID_HEADER] == "rtr/r2"
    assert (loads["ing-1"].routed, loads["ing-2"].routed) == (1, 1)
    # HAProxy's map lacked ing-2 as well (a pin-miss): released, and counted once as the fallback it was.
    asyncio.run(router.unrouted("r1"))
    core = router.table.cores["Engine-a"]
    assert loads["ing-2"].active_requests == 0 and loads["ing-2"].recent(core.now()) == 0
    assert (router.decisions, router.fallbacks, router.pin_misses) == (1, 1, 1)


def test_the_ingress_settles_every_forwarded_post_with_its_router():
    from serve_app.engine.local_client import LocalEngineClient
    from serve_app.routing.types import RouteRequest

    class Engine:
        kv_events_port, kv_replay_port, block_size, dead = 5551, 5552, 128, False

    router = RouterHandle()
    client = LocalEngineClient({"Engine-a": Engine()}, replica_id="ing-1")
    client.settle("rtr/r0", "r0")  # not reporting to a Router (no front door): nothing to tell

    async def run():
        client.report_to(router, "10.0.0.7")
        await client.choose("Engine-a", RouteRequest(request_id="rtr/r1"))  # its stream reports its own end
        client.settle("rtr/r1", "r1")
        client.settle("rtr/r2", "r2")  # never reached an engine
        client.settle(None, "r3")  # arrived without a route id
        client.settle("", "r5")  # the Router reserved nothing for it (no key, or Serve's own choice)
        client.settle(None, None)  # not through HAProxy at all
        await asyncio.sleep(0.01)
        client.shutdown()

    asyncio.run(run())
    assert router.abandoned.calls == [("rtr/r2",)]
    assert router.unrouted.calls == [("r3",)]
    assert not client._claimed


def test_the_reports_middleware_settles_each_post_after_its_response():
    from starlette.responses import PlainTextResponse

    from serve_app.ingress.front_door_reports import FrontDoorReportsMiddleware

    settled, sent = [], []

    class Engines:
        def settle(self, route_id, request_id):
            settled.append((route_id, request_id, list(sent)))

    async def app(scope, receive, send):
        if scope["path"] == "/boom":
            raise RuntimeError("boom")
        await PlainTextResponse("ok")(scope, receive, send)

    mw = FrontDoorReportsMiddleware(app, Engines())

    def call(method, path, headers):
        scope = {"type": "http", "method": method, "path": path, "headers": headers, "query_string": b""}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message["type"])

        asyncio.run(mw(scope, receive, send))

    call("POST", "/v1/messages/count_tokens", [(ROUTE_ID_HEADER.encode(), b"rtr/r1"), (b"x-request-id", b"r1")])
    assert settled == [("rtr/r1", "r1", ["http.response.start", "http.response.body"])]  # after the last byte
    call("GET", "/v1/models", [(b"x-request-id", b"r2")])  # HAProxy asks the Router for POSTs only
    call("POST", "/v1/chat/completions", [(b"x-request-id", b"r3")])
    with pytest.raises(RuntimeError):
        call("POST", "/boom", [(ROUTE_ID_HEADER.encode(), b"rtr/r4")])
    assert [(r, q) for r, q, _ in settled] == [("rtr/r1", "r1"), (None, "r3"), ("rtr/r4", None)]


def test_the_front_doors_router_opens_the_store_as_the_ingress_does(tmp_path):
    """`response_store_placement: ingress`: the Router opens the same database itself; a store deployment: its
    handle; each read gets at most half of HAProxy's wait for the hook."""
    from serve_app.ingress.responses.store import AsyncStore, ResponseStoreCore
    from serve_app.routing.front_door_deployment import history_reader

    def cfg(**ingress):
        return AppSettings.model_validate({"models": [{"id": "m"}], "engine_placement": "ingress",
                                           "router": {"front_door": True}, "ingress": {"direct_ingress": True, **ingress}})

    local = history_reader(cfg(response_store_placement="ingress", response_store_path=str(tmp_path / "r.db"),
                               response_store_timeout_s=1.0), None, 5.0)
    assert isinstance(local.store.backend, AsyncStore) and local.budget_s == 1.0
    assert (tmp_path / "r.db").exists()
    handle = ResponseStoreCore()
    through = history_reader(cfg(), handle, 5.0)
    assert through.store.backend is handle and through.budget_s == 2.5
    assert through.store.recent.max_bytes == 64 << 20  # keeps what it reads, as the ingress keeps what it stores
    assert history_reader(cfg(response_store_recent_bytes=0), handle, 5.0).store.recent is None
    assert history_reader(cfg(), None, 5.0) is None
