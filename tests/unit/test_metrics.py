"""Metrics: the recording functions, the event-stream instrumentation and the /metrics route."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client.parser import text_string_to_metric_families

from serve_app import metrics
from serve_app.errors import ServiceError
from serve_app.settings import ApiKey
from serve_app.conversation import Finish, ReasoningDelta, TextDelta, ToolCallStart, Usage
from serve_app.ingress.auth import check_api_key
from serve_app.ingress.metrics_routes import RequestMetricsMiddleware, api_of, router


def _value(name: str, **labels) -> float:
    v = metrics.REGISTRY.get_sample_value(metrics.PREFIX + name, labels)
    return v or 0.0


def test_observe_functions_land_in_the_registry():
    before = _value("requests_total", api="anthropic", status="529", tenant="none")
    rejected = _value("overload_rejections_total", api="anthropic")
    metrics.observe_request("anthropic", 529)
    assert _value("requests_total", api="anthropic", status="529", tenant="none") == before + 1
    assert _value("overload_rejections_total", api="anthropic") == rejected + 1
    chat_rejected = _value("overload_rejections_total", api="chat")
    metrics.observe_request("chat", 503)  # the OpenAI APIs' overload status
    assert _value("overload_rejections_total", api="chat") == chat_rejected + 1
    metrics.observe_request("anthropic", 429, "team-a")
    assert _value("requests_total", api="anthropic", status="429", tenant="team-a") == 1

    n = _value("ttft_seconds_count", api="unit")
    metrics.observe_ttft("unit", 0.2)
    assert _value("ttft_seconds_count", api="unit") == n + 1
    assert _value("ttft_seconds_bucket", api="unit", le="0.25") >= 1

    metrics.observe_router_decision("kv", "kv_hit")
    assert _value("router_decisions_total", policy="kv", outcome="kv_hit") >= 1
    metrics.set_queue_depth("engine", 7)
    assert _value("queue_depth", component="engine") == 7


def test_cached_fraction_is_cached_over_prompt():
    metrics.observe_usage("frac", prompt_tokens=1000, cached_tokens=750, completion_tokens=10)
    assert _value("cached_token_fraction_sum", api="frac") == 0.75
    assert _value("cached_tokens_total", api="frac", tenant="none") == 750
    metrics.observe_usage("frac", prompt_tokens=0, cached_tokens=0)  # no division by zero, no sample
    assert _value("cached_token_fraction_count", api="frac") == 1


async def _events():
    yield Usage(prompt_tokens=100, completion_tokens=0, cached_tokens=64, estimated=True)
    yield ReasoningDelta(text="hm")
    yield TextDelta(text="a")
    yield ToolCallStart(index=0, id="c1", name="f")
    yield Usage(prompt_tokens=100, completion_tokens=3, cached_tokens=80)
    yield Finish(reason="error", error="boom", error_kind="api_error")


def test_instrument_stream_passes_events_through_and_records():
    api = "instr"
    async def run():
        out = []
        async for ev in metrics.instrument_stream(api, _events(), tenant="team-a"):
            out.append(ev)
        return out

    expected = asyncio.run(_collect(_events()))
    got = asyncio.run(run())
    assert got == expected
    assert _value("ttft_seconds_count", api=api) == 1
    assert _value("inter_token_seconds_count", api=api) == 2  # three content events, two gaps
    # The exact Usage, not the estimate, counted as the tenant's.
    assert _value("prompt_tokens_total", api=api, tenant="team-a") == 100
    assert _value("cached_tokens_total", api=api, tenant="team-a") == 80
    assert _value("completion_tokens_total", api=api, tenant="team-a") == 3
    assert _value("prompt_tokens_total", api=api, tenant="none") == 0
    assert _value("finish_total", api=api, reason="error") == 1
    assert _value("errors_total", api=api, kind="api_error") == 1


async def _collect(aiter):
    return [ev async for ev in aiter]


def test_closing_the_instrumented_stream_closes_the_source():
    closed = asyncio.Event()

    async def source():
        try:
            while True:
                yield TextDelta(text="x")
                await asyncio.sleep(0)
        finally:
            closed.set()

    async def run():
        gen = metrics.instrument_stream("close", source())
        await gen.__anext__()
        await gen.aclose()
        return closed.is_set()

    assert asyncio.run(run())


def test_api_of_paths():
    assert api_of("/v1/messages/count_tokens") == "anthropic"
    assert api_of("/v1/responses") == "responses"
    assert api_of("/v1/chat/completions") == "chat"
    assert api_of("/health") == "other"


def test_metrics_route_and_middleware():
    app = FastAPI()
    app.include_router(router)
    app.add_middleware(RequestMetricsMiddleware)

    @app.post("/v1/messages")
    async def _m(request: Request):
        try:
            check_api_key(request.headers, [ApiKey(key="sk-unit-metrics", tenant="unit-tenant")])
        except ServiceError as e:
            return JSONResponse({"error": e.message}, status_code=e.status)
        return {"ok": True}

    # Families the route must list even when this test runs alone.
    metrics.observe_ttft("route", 0.1)
    metrics.observe_usage("route", prompt_tokens=10, cached_tokens=5)
    metrics.observe_router_decision("kv", "cache_hit")
    metrics.set_queue_depth("ingress", 0)

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            labels = dict(api="anthropic", status="200", tenant="unit-tenant")
            before = _value("requests_total", **labels)
            assert (await c.post("/v1/messages", headers={"x-api-key": "sk-unit-metrics"})).status_code == 200
            assert _value("requests_total", **labels) == before + 1
            # A refused key is counted before any tenant is known.
            unauth = dict(api="anthropic", status="401", tenant="none")
            refused = _value("requests_total", **unauth)
            assert (await c.post("/v1/messages", headers={"x-api-key": "wrong"})).status_code == 401
            assert _value("requests_total", **unauth) == refused + 1
            r = await c.get("/metrics")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            names = {f.name for f in text_string_to_metric_families(r.text)}
            assert {"serve_app_requests", "serve_app_ttft_seconds", "serve_app_cached_token_fraction",
                    "serve_app_router_decisions", "serve_app_queue_depth"} <= names

    asyncio.run(run())


def test_ray_gauges_send_only_their_latest_value_when_flushed():
    """A Ray-backed gauge set on every request costs a call into Ray's core worker each time; the flusher keeps
    the latest value per label set and hands Ray only changes, once per period."""
    from serve_app.metrics import _Flusher

    class Manual(_Flusher):
        def _start(self):  # flushed by the test, not by a thread
            pass

    sent = []
    flusher = Manual()
    ingress = flusher.recorder(lambda v, tags: sent.append((tags["component"], v)), {"component": "ingress"})
    engine = flusher.recorder(lambda v, tags: sent.append((tags["component"], v)), {"component": "engine"})
    for depth in (1, 2, 3, 2, 1, 0):
        ingress(depth)
    engine(7)
    flusher.flush()
    assert sorted(sent) == [("engine", 7), ("ingress", 0)]
    flusher.flush()  # nothing changed: nothing sent
    assert len(sent) == 2
    ingress(0)  # set again, even to the same value: sent (the gauge is current)
    flusher.flush()
    assert sent[2:] == [("ingress", 0)]
