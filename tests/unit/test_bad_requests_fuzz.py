"""Mutated requests through the whole ingress: whatever a client sends, the answer is a 2xx or a 4xx in the API's
own envelope, never a 5xx or a stream that fails.

Valid bodies of every route (the SDK parameter tables of test_sdk_params.py, tool loops of each API, the token
routes) have random parts replaced, removed or added: nulls, wrong types, huge numbers, empty and long strings,
lone surrogates, NUL and bidi characters, unknown fields and block types, and forced tool choices. Each goes
through the real app, the real GenerationService and each model family's real template and parsers (SmolLM2's
tokenizer under the family's template, as tests/unit/test_families_engine.py serves it); only the engine is a stub
that answers text or a hermes tool call (tests/support/scripted_engines.py). The exploration that led here found a tool schema whose `properties` is
a list failing every parser construction with a 500 (serve_app/parsers/schema.py).
"""

from __future__ import annotations

import asyncio
import copy
import json
import random

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app.ingress.context import IngressContext
from serve_app.ingress.server import create_app
from serve_app.parsers.schema import ToolSchemas
from serve_app.service import GenerationService
from serve_app.settings import AppSettings
from tests.support.scripted_engines import ScriptedEngines
from test_sdk_params import ANTHROPIC, ANTHROPIC_REFUSED, CHAT, CHAT_REFUSED, RESPONSES, RESPONSES_REFUSED

FAMILIES = ["nemotron-3", "qwen3-coder", "qwen3", "glm-4.6", "glm-4.7", "kimi-k2", "deepseek-v3.1", "gpt-oss",
            "minimax-m2", "gemma-4", "kimi-k3", "qwen3.5", "qwen3.6", "qwen3.8", "step-3.5-flash",
            "ministral-3", "deepseek-v3.2", "deepseek-v4", "deepseek-v4.1"]
MODELS = ["m", *FAMILIES]
ANSWERS = ["Sure.", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', "plain \U0001F600 text"]


BASH = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
SEEDS = [
    ("/v1/messages", {k: v for k, v in ANTHROPIC.items() if k not in ANTHROPIC_REFUSED}),
    ("/v1/messages", {"model": "m", "max_tokens": 100, "stream": True, "messages": [
        {"role": "user", "content": "run ls"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "x"}, {"type": "text", "text": "ok"},
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.txt"}]},
            {"type": "text", "text": "go on"}]}],
        "tools": [{"name": "Bash", "description": "Run a command", "input_schema": BASH}]}),
    ("/v1/messages/count_tokens", {"model": "m", "system": "s", "messages": [{"role": "user", "content": "hi"}],
                                   "tools": [{"name": "Bash", "input_schema": BASH}]}),
    # logit_bias's token is GPT-2's end of text, outside SmolLM2's vocabulary: a 400 every time
    ("/v1/chat/completions", {k: v for k, v in CHAT.items() if k not in CHAT_REFUSED and k != "logit_bias"}),
    ("/v1/chat/completions", {"model": "m", "stream": False, "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "run ls"},
        {"role": "assistant", "content": None, "reasoning_content": "hm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "out"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}),
    ("/v1/responses", {k: v for k, v in RESPONSES.items() if k not in RESPONSES_REFUSED}),
    ("/v1/responses", {"model": "m", "stream": False, "store": False, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "run ls"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}},
                  {"type": "custom", "name": "apply_patch"}]}),
    ("/v1/tokenize", {"model": "m", "prompt": "hello"}),
    ("/v1/tokenize", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/detokenize", {"model": "m", "tokens": [1, 2, 3]}),
]
FORCED = {  # tool choices that make the service build a grammar for the family's call format
    "/v1/messages": [{"type": "any"}, {"type": "tool", "name": "Bash"}, {"type": "none"}],
    "/v1/chat/completions": ["required", {"type": "function", "function": {"name": "f"}}, "none"],
    "/v1/responses": ["required", {"type": "function", "name": "f"}, {"type": "custom", "name": "apply_patch"},
                      {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "f"}]}],
}
ODD = [None, "", "x" * 5000, 0, -1, 2 ** 63, -2 ** 70, 1e308, -0.0, 1.5, 1e-320, True, False, [], {}, [None], [[]],
       {"type": "bogus"}, {"type": "text"}, {"type": "text", "text": None}, "\ud800", "\x00", "\u202e", "NaN",
       [{"type": "image"}], {"": 1}, {"type": "function"}, ["a", 1], "auto", "none", "required", {"type": "tool"},
       {"type": "any"}, {"type": "function", "name": None}, [{"role": "user"}], [{"role": "assistant", "content": []}],
       [{"role": "tool", "content": "x"}], {"type": "object", "properties": None}, {"type": "object", "properties": []},
       {"anyOf": 3, "enum": 7}]


def _paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, path + (i,))


def mutate(body: dict, rng: random.Random) -> dict:
    out = copy.deepcopy(body)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        path = rng.choice([p for p in _paths(out) if p])
        parent = out
        for key in path[:-1]:
            parent = parent[key]
        r = rng.random()
        if r < 0.15 and isinstance(parent, dict):
            del parent[path[-1]]
        elif r < 0.2 and isinstance(parent, list):
            parent.append(copy.deepcopy(rng.choice(ODD)))
        elif r < 0.25 and isinstance(parent, dict):
            parent["zz_unknown"] = copy.deepcopy(rng.choice(ODD))
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(ODD))
        if not any(p for p in _paths(out)):
            break
    return out


@pytest.fixture(scope="module")
def served():
    from serve_app.engine.provision import ensure_model

    cfg = AppSettings.model_validate({
        "engine_placement": "ingress", "ingress": {"direct_ingress": True},
        "models": [{"id": "m", "aliases": ["claude-sonnet-4-6", "gpt-5.5"], "max_model_len": 8192,
                    "max_output_tokens": 1024, "tool_parser": "hermes",
                    "chat_template": "serve_app/templates/smollm2_tools.jinja"}]
        + [{"id": f, "family": f, "family_template": True, "max_model_len": 8192, "max_output_tokens": 1024}
           for f in FAMILIES]})
    path = ensure_model("smollm2-135m-instruct")
    engines = ScriptedEngines()
    service = GenerationService(cfg, engines, model_paths={m: path for m in MODELS})
    return create_app(IngressContext(settings=cfg, service=service, secret=b"s" * 32)), engines


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def post(served, loop, path: str, body, answer: int = 0) -> httpx.Response:
    app, engines = served
    engines.script, engines.split_seed = ANSWERS[answer % len(ANSWERS)], answer

    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            return await c.post(path, content=json.dumps(body), headers={
                "content-type": "application/json", "anthropic-version": "2023-06-01"})

    return loop.run_until_complete(go())


def check(path: str, body, r: httpx.Response) -> None:
    what = f"{path} {json.dumps(body)[:2000]}\n-> {r.status_code} {r.text[:1000]}"
    assert r.status_code < 500, what
    if r.status_code >= 400:
        err = r.json()
        assert isinstance(err.get("error"), dict) and err["error"].get("message"), what
        if path.startswith("/v1/messages"):
            assert err["type"] == "error" and err["error"]["type"].endswith("_error"), what
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert "event: error" not in r.text and '"type":"response.failed"' not in r.text, what
        assert '"finish_reason":"error"' not in r.text, what


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2 ** 32 - 1))
def test_any_mutated_request_is_answered_or_refused_in_the_apis_envelope(served, loop, seed):
    rng = random.Random(seed)
    path, seed_body = rng.choice(SEEDS)
    body = mutate(seed_body, rng)
    if isinstance(body, dict) and "model" in body and rng.random() < 0.7:
        body["model"] = rng.choice(MODELS)
    if path in FORCED and "tools" in seed_body and rng.random() < 0.3:
        body["tool_choice"] = copy.deepcopy(rng.choice(FORCED[path]))
    check(path, body, post(served, loop, path, body, seed))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("schema", [{"type": "object", "properties": [{"role": "user"}]},
                                    {"type": "object", "properties": {"a": {"anyOf": 3, "enum": 7}}},
                                    {"type": "object", "properties": {"a": {"enum": 7}}, "required": 5}])
def test_a_malformed_tool_schema_is_no_server_error(served, loop, model, schema):
    """Tool schemas are the client's: one of the wrong shape types nothing for the parsers and never fails the
    request on the server's side (it once was a 500 on every API)."""
    for path, body in (
            ("/v1/messages", {"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"name": "f", "input_schema": schema}]}),
            ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                      "tools": [{"type": "function", "function": {"name": "f",
                                                                                  "parameters": schema}}]}),
            ("/v1/responses", {"model": model, "input": "hi", "store": False,
                               "tools": [{"type": "function", "name": "f", "parameters": schema}]})):
        for stream in (False, True):
            check(path, body, post(served, loop, path, {**body, "stream": stream}))


def test_tool_schemas_of_any_shape_type_what_they_can():
    schemas = ToolSchemas([
        {"name": "a", "input_schema": {"properties": [1, 2]}},
        {"name": ["not", "a", "name"], "parameters": {"properties": {"x": {"type": "string"}}}},
        {"type": "function", "function": {"name": "b", "parameters": {"properties": {
            "n": {"anyOf": 3}, "e": {"enum": 7}, "s": {"enum": ["x", "y"]}, "i": {"type": "integer"}}}}},
    ])
    assert not schemas.declares("a", "0") and schemas.types("a", "x") == frozenset()
    assert schemas.types("b", "n") == frozenset() and schemas.types("b", "e") == frozenset()
    assert schemas.streams_as_string("b", "s") and schemas.types("b", "i") == {"integer"}
