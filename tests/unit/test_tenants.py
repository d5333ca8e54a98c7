"""Tenants: keys -> tenants (backward compatible), cache salts, allowed models, limits shared by all ingress
replicas, 429s with each vendor's rate-limit headers in the API's own envelope. No Ray: the limit state the
TenantLimits deployment owns is a plain `LimitState`, shared here by two ingress apps as it is by two replicas."""

from __future__ import annotations

import asyncio
import json
import logging

import anthropic
import httpx
import openai
import pytest
from pydantic import ValidationError

from serve_app import tenants
from serve_app.engine.types import EngineChunk
from serve_app.errors import ServiceError
from serve_app.ingress.auth import check_api_key
from serve_app.ingress.context import IngressContext
from serve_app.ingress.limits import LimitClient, rate_limit_headers
from serve_app.ingress.server import create_app
from serve_app.limits import WINDOW_S, LimitState
from serve_app.settings import AppSettings, IngressConfig
from test_service import ReplayEngines, StubRenderer

INGRESS = {
    "api_keys": [
        "plain-key",
        {"key": "key-a", "tenant": "alice"},
        {"key": "key-a2", "tenant": "alice"},
        {"key": "key-b", "tenant": "bob"},
        {"key": "key-c", "tenant": "carol"},
    ],
    "tenants": {
        "alice": {"cache_group": "acme", "requests_per_minute": 2},
        "bob": {"tokens_per_minute": 250, "models": ["m"]},
        "carol": {"cache_group": "acme", "max_concurrent_requests": 1},
    },
}


def ingress(**over) -> IngressConfig:
    return IngressConfig.model_validate({**INGRESS, **over})


# -- configuration and keys ----------------------------------------------------------------------------------


def test_a_plain_key_list_still_works():
    cfg = IngressConfig.model_validate({"api_keys": ["k1", "k2"]})
    assert tenants.resolve({"x-api-key": "k2"}, cfg.api_keys) == tenants.DEFAULT
    assert tenants.resolve({}, []) == tenants.DEFAULT  # no keys: open


def test_keys_map_to_tenants_in_either_header():
    cfg = ingress()
    assert tenants.resolve({"x-api-key": "key-a"}, cfg.api_keys) == "alice"
    assert tenants.resolve({"authorization": "Bearer key-a2"}, cfg.api_keys) == "alice"
    assert tenants.resolve({"x-api-key": "plain-key"}, cfg.api_keys) == tenants.DEFAULT
    for headers, message in (({}, "missing API key"), ({"x-api-key": "key-"}, "invalid API key")):
        with pytest.raises(ServiceError) as e:
            tenants.resolve(headers, cfg.api_keys)
        assert e.value.status == 401 and message in e.value.message


def test_an_entry_without_key_takes_requests_no_key_matches():
    cfg = ingress(api_keys=[*INGRESS["api_keys"], {"tenant": "default"}])
    assert tenants.resolve({}, cfg.api_keys) == tenants.DEFAULT
    assert tenants.resolve({"x-api-key": "unused"}, cfg.api_keys) == tenants.DEFAULT
    assert tenants.resolve({"x-api-key": "key-b"}, cfg.api_keys) == "bob"


def test_config_errors_name_the_problem_never_the_key():
    with pytest.raises(ValidationError, match="tenant 'nobody' is not in ingress.tenants"):
        IngressConfig.model_validate({"api_keys": [{"key": "k", "tenant": "nobody"}]})
    with pytest.raises(ValidationError) as e:
        IngressConfig.model_validate({"api_keys": ["secret-value", {"key": "secret-value", "tenant": "default"}]})
    assert "listed twice" in str(e.value) and "secret-val" not in str(e.value)
    with pytest.raises(ValidationError) as e:
        IngressConfig.model_validate({"api_keys": [{"key": "secret-value"}]})  # no tenant
    assert "secret-val" not in str(e.value)


def test_check_api_key_sets_the_requests_tenant():
    cfg = ingress()
    token = tenants.CURRENT.set(None)
    try:
        assert check_api_key({"x-api-key": "key-b"}, cfg.api_keys) == "bob"
        assert tenants.CURRENT.get() == "bob"
    finally:
        tenants.CURRENT.reset(token)


def test_cache_salts_separate_tenants_and_join_an_organisation():
    cfg = ingress()
    salts = {t: tenants.cache_salt(cfg, t) for t in ("alice", "bob", "carol", tenants.DEFAULT)}
    assert salts["alice"] == salts["carol"]  # one cache_group
    assert salts["bob"] not in (salts["alice"], None)
    assert salts[tenants.DEFAULT] is None  # the shared cache the service always had


def test_the_namespaces_a_request_can_be_served_under_are_the_keyed_tenants_salts():
    # Plain keys reach the default tenant; alice and carol share one group: three namespaces, the default's first.
    assert tenants.routing_salts(ingress()) == [None, "tenant-cache:acme", "tenant-cache:bob"]
    # Named tenants only: the unkeyed default namespace is never served, so it is not a candidate.
    named = ingress(api_keys=[{"key": "key-a", "tenant": "alice"}, {"key": "key-c", "tenant": "carol"}])
    assert tenants.routing_salts(named) == ["tenant-cache:acme"]
    # An open entry's tenant is reachable too; no keys at all is the default tenant alone.
    opened = ingress(api_keys=[{"key": "key-b", "tenant": "bob"}, {"tenant": "alice"}])
    assert tenants.routing_salts(opened) == ["tenant-cache:acme", "tenant-cache:bob"]
    assert tenants.routing_salts(ingress(api_keys=[])) == [None]


# -- the limit state (deterministic clock: no timing in these tests) -------------------------------------------


def test_requests_per_minute_slide_and_say_when_to_retry():
    st, lim = LimitState(), {"requests_per_minute": 2}
    t0 = 10 * WINDOW_S  # the start of a window
    assert st.acquire("a", lim, 1, t0).ok and st.acquire("a", lim, 1, t0 + 1).ok
    v = st.acquire("a", lim, 1, t0 + 2)
    assert not v.ok and "requests per minute" in v.reason and v.snapshot["requests"]["remaining"] == 0
    # Both requests are in this window: room again once half of it has slid out in the next one.
    assert v.retry_after == WINDOW_S - 2 + WINDOW_S / 2
    assert not st.acquire("a", lim, 1, t0 + WINDOW_S + WINDOW_S / 2 - 1).ok
    assert st.acquire("a", lim, 1, t0 + WINDOW_S + WINDOW_S / 2 + 0.01).ok
    assert st.acquire("other", lim, 1, t0 + 2).ok  # per tenant


def test_tokens_count_prompt_at_admission_and_output_at_release():
    st, lim = LimitState(), {"tokens_per_minute": 100}
    t0 = 5 * WINDOW_S
    v = st.acquire("a", lim, 60, t0)
    assert v.ok and v.snapshot["tokens"]["remaining"] == 40
    st.release(v.lease, 30, t0 + 1)
    st.release(v.lease, 30, t0 + 1)  # idempotent
    assert st.snapshot("a", lim, t0 + 1)["tokens"]["remaining"] == 10
    refused = st.acquire("a", lim, 20, t0 + 2)
    assert not refused.ok and "tokens per minute" in refused.reason
    assert st.acquire("b", lim, 500, t0).ok  # a prompt larger than the limit fits an empty window, once
    assert not st.acquire("b", lim, 1, t0).ok


def test_concurrency_leases_release_and_expire():
    from serve_app.limits import LEASE_TTL_S

    st, lim = LimitState(), {"max_concurrent_requests": 1}
    first = st.acquire("a", lim, 1, 0.0)
    assert first.ok and not st.acquire("a", lim, 1, 1.0).ok
    st.release(first.lease, 0, 2.0)
    second = st.acquire("a", lim, 1, 3.0)
    assert second.ok
    # Never released (its ingress replica died): the slot comes back when the lease expires.
    assert not st.acquire("a", lim, 1, 3.0 + LEASE_TTL_S - 1).ok
    assert st.acquire("a", lim, 1, 3.0 + LEASE_TTL_S + 1).ok


def test_headers_in_each_vendors_names():
    snap = {"requests": {"limit": 2, "remaining": 0, "reset_s": 90.0}, "tokens": {"limit": 9, "remaining": 4,
                                                                                 "reset_s": 0.25}}
    a = dict(rate_limit_headers(snap, anthropic=True, now=0.0))
    assert a["anthropic-ratelimit-requests-limit"] == "2" and a["anthropic-ratelimit-requests-remaining"] == "0"
    assert a["anthropic-ratelimit-requests-reset"] == "1970-01-01T00:01:30Z"
    assert a["anthropic-ratelimit-tokens-remaining"] == "4"
    o = dict(rate_limit_headers(snap, anthropic=False, now=0.0))
    assert o["x-ratelimit-limit-requests"] == "2" and o["x-ratelimit-reset-requests"] == "1m30s"
    assert o["x-ratelimit-remaining-tokens"] == "4" and o["x-ratelimit-reset-tokens"] == "250ms"


# -- through the real app and GenerationService (stub engine client), two ingress replicas ---------------------


def settings(**ingress_over) -> AppSettings:
    return AppSettings.model_validate({
        "models": [{"id": "m", "max_model_len": 1000, "max_output_tokens": 300}, {"id": "other"}],
        "ingress": {**INGRESS, **ingress_over},
    })


def replica(cfg: AppSettings, shared: LimitState, engines: ReplayEngines):
    from serve_app.service import GenerationService

    svc = GenerationService(cfg, engines, limiter=LimitClient(shared))
    svc._renderers["m"] = StubRenderer(100)
    svc._renderers["other"] = StubRenderer(100)
    return create_app(IngressContext(settings=cfg, service=svc, secret=b"s"))


def engines() -> ReplayEngines:
    first = EngineChunk("Hi", [1, 2], num_cached_tokens=0, engine_ms={"handoff": 0.5, "queued": 2.0, "prefill": 9.0})
    return ReplayEngines([first, EngineChunk("", [3], finish_reason="stop")])


def oai(app, key):
    return openai.AsyncOpenAI(api_key=key, base_url="http://app/v1", max_retries=0,
                              http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))


def claude(app, key):
    import httpx2

    return anthropic.AsyncAnthropic(api_key=key, base_url="http://app", max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)))


async def test_requests_per_minute_hold_across_replicas_with_openai_headers():
    cfg, shared = settings(), LimitState()
    a, b = replica(cfg, shared, engines()), replica(cfg, shared, engines())
    msg = [{"role": "user", "content": "hi"}]
    ok = await oai(a, "key-a").chat.completions.with_raw_response.create(model="m", messages=msg)
    assert ok.headers["x-ratelimit-limit-requests"] == "2" and ok.headers["x-ratelimit-remaining-requests"] == "1"
    await oai(b, "key-a2").chat.completions.create(model="m", messages=msg)  # same tenant, other replica
    with pytest.raises(openai.RateLimitError) as e:
        await oai(a, "key-a").chat.completions.create(model="m", messages=msg)
    r = e.value.response
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.value.code == "rate_limit_exceeded"
    from serve_app.metrics import REGISTRY

    assert REGISTRY.get_sample_value("serve_app_tenant_requests_total",
                                     {"tenant": "alice", "outcome": "requests_per_minute"}) >= 1
    # Another tenant is not affected, and gets no rate-limit headers of alice's.
    other = await oai(b, "key-b").chat.completions.with_raw_response.create(model="m", messages=msg)
    assert "x-ratelimit-remaining-requests" not in other.headers


async def test_anthropic_429_in_its_envelope_with_its_headers():
    cfg, shared = settings(), LimitState()
    app = replica(cfg, shared, engines())
    c = claude(app, "key-b")
    msg = [{"role": "user", "content": "hi"}]
    first = await c.messages.with_raw_response.create(model="m", max_tokens=50, messages=msg)
    assert first.headers["anthropic-ratelimit-tokens-limit"] == "250"
    assert int(first.headers["anthropic-ratelimit-tokens-remaining"]) <= 150  # 100 prompt tokens counted
    await c.messages.create(model="m", max_tokens=50, messages=msg)
    with pytest.raises(anthropic.RateLimitError) as e:
        await c.messages.create(model="m", max_tokens=50, messages=msg)
    assert e.value.body["error"]["type"] == "rate_limit_error" and "tokens per minute" in e.value.message
    # 2 x (100 prompt + 3 output) used: 44 left, less than the next prompt needs.
    assert e.value.response.headers["anthropic-ratelimit-tokens-remaining"] == "44"
    assert int(e.value.response.headers["retry-after"]) >= 1


async def test_disallowed_model_is_403_and_concurrency_frees_on_finish():
    cfg, shared = settings(), LimitState()
    app = replica(cfg, shared, engines())
    with pytest.raises(openai.PermissionDeniedError):
        await oai(app, "key-b").chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    for _ in range(3):  # carol may run one at a time: sequential requests each release their slot
        await oai(app, "key-c").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert shared.in_flight("carol", 0.0) == 0


async def test_concurrent_requests_over_the_limit_get_429():
    cfg, shared = settings(), LimitState()
    gate = asyncio.Event()

    class Slow(ReplayEngines):
        async def _chunks(self):
            await gate.wait()
            yield EngineChunk("", [3], num_cached_tokens=0, finish_reason="stop")

    app = replica(cfg, shared, Slow())
    msg = [{"role": "user", "content": "x"}]
    running = asyncio.create_task(oai(app, "key-c").chat.completions.create(model="m", messages=msg))
    while shared.in_flight("carol", 0.0) == 0:
        await asyncio.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as e:
        await oai(app, "key-c").chat.completions.create(model="m", messages=msg)
    assert "concurrent requests" in e.value.message
    gate.set()
    await running
    assert shared.in_flight("carol", 0.0) == 0


class _RemoteLimits:
    """The TenantLimits deployment's shape through a Serve handle: each call is in flight until awaited or landed,
    and a release lands a while after it is sent (another process, another hop)."""

    def __init__(self, state: LimitState, release_delay_s: float):
        self.state, self.delay = state, release_delay_s
        self.acquire = self._Method(self._acquire)
        self.release = self._Method(self._release)

    class _Method:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args):
            return asyncio.ensure_future(self.fn(*args))

    async def _acquire(self, tenant, limits, prompt_tokens):
        import time

        return self.state.acquire(tenant, limits, prompt_tokens, time.time()).to_dict()

    async def _release(self, lease, output_tokens):
        import time

        await asyncio.sleep(self.delay)
        self.state.release(lease, output_tokens, time.time())


@pytest.mark.parametrize("stream", [False, True])
async def test_the_next_request_right_after_the_end_finds_the_slot_free(stream):
    """carol may run one request at a time; the shared limit state is another process, and her next request goes
    out the moment she reads the end of the last one: the release must have landed before that end was sent."""
    from serve_app.service import GenerationService

    cfg, shared = settings(), LimitState()
    svc = GenerationService(cfg, engines(), limiter=LimitClient(_RemoteLimits(shared, release_delay_s=0.05)))
    svc._renderers["m"] = StubRenderer(100)
    app = create_app(IngressContext(settings=cfg, service=svc, secret=b"s"))
    client = oai(app, "key-c")
    for _ in range(3):
        out = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                   stream=stream)
        if stream:
            async for _chunk in out:
                pass
    assert shared.in_flight("carol", 0.0) == 0


async def test_requests_carry_the_tenants_salt_to_the_engine_and_the_router():
    from serve_app.routing.hashing import block_hashes

    cfg, eng = settings(), engines()
    app = replica(cfg, LimitState(), eng)
    msg = [{"role": "user", "content": "x"}]
    for key in ("key-a", "key-c", "key-b", "plain-key"):
        await oai(app, key).chat.completions.create(model="m", messages=msg)
    salts = [r.cache_salt for r in eng.requests]
    assert salts[0] == salts[1] == "tenant-cache:acme" and salts[2] == "tenant-cache:bob" and salts[3] is None
    ids = list(range(100))  # StubRenderer's prompt
    assert [r.block_hashes for r in eng.routes] == [block_hashes(ids, 16, salt=s) for s in salts]


async def test_one_json_log_line_per_request_without_text_or_key(capsys):
    cfg = settings()
    app = replica(cfg, LimitState(), engines())
    await oai(app, "key-b").chat.completions.create(model="m", messages=[{"role": "user", "content": "my secret"}])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert len(lines) == 1
    line = lines[0]
    assert line["tenant"] == "bob" and line["api"] == "chat" and line["model"] == "m"
    assert line["prompt_tokens"] == 100 and line["output_tokens"] == 3 and line["cached_tokens"] == 0
    assert line["finish_reason"] == "stop" and line["replica"] == "r1" and line["route"] == "kv"
    assert line["ttft_s"] is not None and line["duration_s"] >= line["ttft_s"]
    # Where the time to first token went, step by step from the request's arrival, in the order they happen.
    phases = line["phases_ms"]
    assert list(phases) == ["http", "parse", "render", "tenant", "route", "accept", "first_token"]
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) / 1000 >= line["ttft_s"] - 0.002  # from arrival, so at least the service's TTFT
    assert line["engine_ms"] == {"handoff": 0.5, "queued": 2.0, "prefill": 9.0}  # the replica's, as it sent them
    assert "my secret" not in json.dumps(line) and "key-b" not in json.dumps(line)


async def test_the_log_line_names_the_replica_that_ran_the_request(capsys):
    """Serve's handle gave it to another replica than the Router chose (or it was handed over from a lost one):
    the engine client keeps where it runs on the request (ingress/clients.py), and the log says that replica."""
    eng = engines()
    opened = eng.open

    async def taken_elsewhere(key, req):
        chunks = await opened(key, req)
        req.target_replica = "r2"
        return chunks

    eng.open = taken_elsewhere
    app = replica(settings(), LimitState(), eng)
    await oai(app, "key-b").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [(x["replica"], x["route"]) for x in lines] == [("r2", "kv")]


async def test_a_streamed_request_logs_when_its_first_token_frame_left(capsys):
    gate = asyncio.Event()

    class Held(ReplayEngines):  # the stream goes on only once the client has the first token
        async def _chunks(self):
            yield EngineChunk("Hi", [1, 2], num_cached_tokens=0)
            await gate.wait()
            yield EngineChunk("", [3], finish_reason="stop")

    inner = replica(settings(), LimitState(), Held())

    async def app(scope, receive, send):  # httpx's ASGI transport hands the client the body only at its end
        async def sent(message):
            await send(message)
            if message["type"] == "http.response.body" and b"Hi" in message.get("body", b""):
                gate.set()
        await inner(scope, receive, sent)

    stream = await oai(app, "key-b").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                            stream=True)
    async for _ in stream:
        pass
    line = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")][-1]
    # after the first token reached the ingress: its frame handed to the HTTP server
    assert list(line["phases_ms"])[-2:] == ["first_token", "first_frame"]
    assert line["phases_ms"]["first_frame"] >= 0


async def test_model_list_shows_only_the_tenants_models():
    app = replica(settings(), LimitState(), engines())
    assert [m.id async for m in oai(app, "key-b").models.list()] == ["m"]
    assert len([m async for m in oai(app, "key-a").models.list()]) == 2
    with pytest.raises(openai.NotFoundError):
        await oai(app, "key-b").models.retrieve("other")


async def test_an_unavailable_limiter_admits_instead_of_failing(caplog):
    class Down:
        class acquire:  # noqa: N801 - the shape of a DeploymentHandle method
            @staticmethod
            def remote(*args):
                raise RuntimeError("actor died")

    with caplog.at_level(logging.WARNING):
        verdict = await LimitClient(Down()).acquire("alice", ingress().tenants["alice"], 10)
    assert verdict.ok and verdict.lease is None and "admitting without them" in caplog.text


# -- scheduling tiers -----------------------------------------------------------------------------------------------


def test_a_tenants_priority_is_a_tier_its_requests_hints_never_leave():
    from serve_app.tenants import SPECULATIVE_PRIORITY, engine_priority

    cfg = ingress(tenants={**INGRESS["tenants"], "interactive": {"priority": 10}, "ci": {"priority": -5}})
    # vLLM runs lower values first; the default tenant (and one without a priority) is tier 0.
    assert engine_priority(cfg, None, None) == engine_priority(cfg, "bob", None) == 0
    assert engine_priority(cfg, None, 3) == -3  # within a tier, the hint orders as before
    top_ci = engine_priority(cfg, "ci", 10**9)
    low_default = engine_priority(cfg, None, -(10**9))
    low_interactive = engine_priority(cfg, "interactive", -(10**9))
    top_default = engine_priority(cfg, None, 10**9)
    assert low_interactive < top_default < low_default < top_ci  # a hint never crosses into another tier
    assert max(engine_priority(cfg, "ci", h) for h in (-(10**9), None)) < SPECULATIVE_PRIORITY
    worst = engine_priority(ingress(tenants={**INGRESS["tenants"], "t": {"priority": -100}}), "t", -(10**9))
    assert worst < SPECULATIVE_PRIORITY  # the warm-ups yield to every real request
    with pytest.raises(ValueError):
        ingress(tenants={**INGRESS["tenants"], "t": {"priority": 101}})


async def test_a_tenants_tier_reaches_the_engine_request():
    cfg = settings(tenants={**INGRESS["tenants"], "bob": {"priority": 2, "share": 3}})
    eng = engines()
    app = replica(cfg, LimitState(), eng)
    msg = [{"role": "user", "content": "x"}]
    await oai(app, "key-b").chat.completions.create(model="m", messages=msg,
                                                    extra_body={"nvext": {"agent_hints": {"priority": 7}}})
    await oai(app, "key-a").chat.completions.create(model="m", messages=msg)
    assert [r.priority for r in eng.requests] == [-2007, 0]
    # and whose share of the engine's queue it takes (engine/fair_share.py)
    assert [r.tenant for r in eng.requests] == ["bob", "alice"]
    assert [r.share for r in eng.requests] == [3, 1]  # its weight there (TenantConfig.share; unset: 1)
    with pytest.raises(ValueError):
        ingress(tenants={**INGRESS["tenants"], "t": {"share": 0}})


async def test_with_fair_share_off_no_request_is_charged_to_its_tenant():
    eng = engines()
    app = replica(settings(fair_share=False), LimitState(), eng)
    await oai(app, "key-b").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert [r.tenant for r in eng.requests] == [None]
