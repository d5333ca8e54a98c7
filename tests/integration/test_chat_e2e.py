"""The whole path (Ray Serve proxy → Ingress → Router → vLLM engine) through the real `openai` SDK."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
LONG = "smollm2-135m-instruct-32k"  # its own engine: 32K context, 4K sliding window (tests/configs/test.yaml)
SLASHED = "org/smollm2-test"  # an alias of MODEL in tests/configs/test.yaml: served ids may contain `/`


@pytest.fixture(scope="module")
def client(serve_url):
    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(client, content, **kw):
    return client.chat.completions.create(
        model=kw.pop("model", MODEL), messages=[{"role": "user", "content": content}], temperature=0, **kw
    )


def test_capital_of_france(client):
    r = ask(client, "What is the capital of France?", max_tokens=30)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_the_long_context_engine_is_the_native_model_within_its_window(client):
    """The 32K engine (every layer a 4K sliding window, `sliding_window` in tests/configs/test.yaml) answers a short
    prompt token for token as the 8K engine with the same weights does: within the window nothing is stretched.
    (The YaRN x4 stretch it replaced no longer said Paris here.)"""
    native = ask(client, "What is the capital of France?", max_tokens=30)
    long = ask(client, "What is the capital of France?", max_tokens=30, model=LONG)
    assert "Paris" in long.choices[0].message.content
    assert long.choices[0].message.content == native.choices[0].message.content


def test_the_windowed_engine_reuses_a_system_prompt_a_longer_request_ran_past(client, serve_url):
    """Two agent sessions share a ~5.5K-token system prompt; the first session's request runs ~1.5K tokens past it.
    The second, which differs right after the system prompt, must reuse it. On a sliding-window engine vLLM by
    default keeps only the first request's last window, which does not reach back to the system prompt's end, so
    the second request recomputed everything (0 cached); engine/vllm_engine.py keeps every block."""
    rng = random.Random(7)
    words = ["the", "file", "test", "code", "line", "value", "error", "state", "model", "token", "read", "write"]
    system = f"Run {uuid.uuid4().hex}. " + " ".join(rng.choice(words) for _ in range(5500))

    def session(n: int) -> list[dict]:
        task = " ".join(rng.choice(words) for _ in range(1500))
        return [{"role": "system", "content": system}, {"role": "user", "content": f"Session {n}: {task}"}]

    shared = httpx.post(f"{serve_url}/v1/tokenize", json={"model": LONG, "messages": [{"role": "system",
                        "content": system}]}, timeout=60).json()["count"]
    assert shared > 4096 + 256  # the system prompt alone is more than a window
    first = client.chat.completions.create(model=LONG, messages=session(1), max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens > shared + 1024  # the first request ran well past the shared part
    second = client.chat.completions.create(model=LONG, messages=session(2), max_tokens=1, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= shared - 2 * 128, (shared, second.usage)


def test_stream_folds_to_the_same_text_and_usage(client):
    full = ask(client, "Name three colors.", max_tokens=25)
    chunks = list(ask(client, "Name three colors.", max_tokens=25, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    usage = chunks[-1].usage
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        full.choices[0].finish_reason]


def test_usage_counts_are_exact(client, serve_url):
    messages = [{"role": "user", "content": "Count to five."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    tok = httpx.post(f"{serve_url}/v1/tokenize", json={"model": MODEL, "messages": messages}, timeout=60)
    assert tok.status_code == 200, tok.text[:300]
    assert tok.json()["count"] == r.usage.prompt_tokens
    assert r.usage.completion_tokens == 12 or r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_cached_tokens_reported_on_a_repeated_long_prompt(client):
    long = "You are a careful assistant. " * 60  # > one 128-token block
    messages = [{"role": "system", "content": long}, {"role": "user", "content": "Say ok."}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 128


def test_forced_script_comes_back_byte_exact(client):
    script = 'Exactly this: {"a": [1, 2]} — ünïcödé ✓\nline two.'
    r = ask(client, "anything", max_tokens=200, extra_body={"nvext": {"forced_script": script}})
    assert r.choices[0].message.content == script
    assert r.choices[0].finish_reason == "stop"


def test_forced_tool_call_streams_arguments_and_dispatches(client, serve_url):
    args = {"path": "notes.txt", "content": "hello " * 50}
    script = 'Writing.<tool_call>\n{"name": "write_file", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}]
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "write"}], "tools": tools,
            "max_tokens": 400, "nvext": {"forced_script": script, "tool_dispatch": True}}
    events = []
    with httpx.stream("POST", f"{serve_url}/v1/chat/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        name = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                events.append((name, None if data == "[DONE]" else json.loads(data)))
                name = None
    dispatch = [d for n, d in events if n == "tool_call_dispatch"]
    assert len(dispatch) == 1
    assert dispatch[0]["tool_call"]["function"]["name"] == "write_file"
    assert json.loads(dispatch[0]["tool_call"]["function"]["arguments"]) == args
    chunks = [d for n, d in events if n is None and d is not None]
    final_i = next(i for i, (n, d) in enumerate(events) if n is None and d and d["choices"] and d["choices"][0]["finish_reason"])
    dispatch_i = next(i for i, (n, _) in enumerate(events) if n == "tool_call_dispatch")
    assert dispatch_i < final_i
    arg_frags = [tc["function"]["arguments"] for c in chunks for tc in (c["choices"][0]["delta"].get("tool_calls") or [])
                 if tc.get("function", {}).get("arguments")]
    assert len(arg_frags) > 3  # streamed as generated, not in one piece at the end
    assert json.loads("".join(arg_frags)) == args
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "Writing." and "<tool_call>" not in text
    assert events[final_i][1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("max_tokens", [400, 30])
def test_held_tool_calls_through_the_engine_fold_to_the_complete_answer(client, max_tokens):
    """`nvext.hold_tool_calls`: the call goes out whole once complete; cut off by max_tokens (30 tokens end inside
    its arguments) it never goes out, only its text, exactly as the non-streaming answer has it."""
    args = {"path": "notes.txt", "content": "hello " * 20}
    script = 'Writing.<tool_call>\n{"name": "write_file", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}]
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "write"}], "tools": tools,
          "max_tokens": max_tokens, "extra_body": {"nvext": {"forced_script": script, "hold_tool_calls": True}}}
    whole = client.chat.completions.create(**kw).choices[0]
    content, fragments, calls, finish = "", [], {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
                fragments += [tc.function.arguments] if tc.function.arguments else []
            finish = choice.finish_reason or finish
    assert finish == whole.finish_reason == ("tool_calls" if max_tokens == 400 else "length")
    assert content == (whole.message.content or "")
    assert list(calls.values()) == [{"name": t.function.name, "arguments": t.function.arguments}
                                    for t in whole.message.tool_calls or []]
    if max_tokens == 400:
        assert content == "Writing." and len(fragments) == 1 and json.loads(fragments[0]) == args
    else:
        assert calls == {} and content.startswith("Writing.<tool_call>") and len(content) < len(script)


def test_errors_in_openai_envelope(client, serve_url):
    with pytest.raises(openai.NotFoundError) as e:
        ask(client, "hi", model="no-such-model")
    assert e.value.status_code == 404
    err = e.value.response.json()["error"]
    assert err == {"message": "model: no-such-model", "type": "not_found_error", "param": "model",
                   "code": "model_not_found"}
    assert e.value.body == err  # what the SDK hands the caller is that envelope's `error`
    r = httpx.post(f"{serve_url}/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{serve_url}/v1/chat/completions", json={"model": MODEL, "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{serve_url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                             "max_tokens": "lots"})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    r = httpx.get(f"{serve_url}/v1/models/nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert r.json()["error"]["message"] == "model: nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4"


def test_prompt_too_long_says_both_numbers(client):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "word " * 9000, max_tokens=5)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert e.value.body["message"].startswith("This model's maximum context length is 8192 tokens. However, your "
                                              "messages resulted in 9")


def test_context_full_is_length(client):
    """About 8130 prompt tokens of the 8K engine's 8192 and max_tokens 200: the context fills first."""
    r = ask(client, "hi " * 8100, max_tokens=200, extra_body={"nvext": {"forced_script": "story " * 300}})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8192 - r.usage.prompt_tokens < 200


def test_max_tokens_beyond_the_context_is_clamped(client):
    r = ask(client, "Say hi.", max_tokens=10**6, extra_body={"nvext": {"forced_script": "hi"}})
    assert r.choices[0].message.content == "hi"


def test_models_endpoints(client, serve_url):
    ids = {m.id for m in client.models.list().data}
    assert {"smollm2-135m-instruct", "smollm2", "claude-sonnet-4-6"} <= ids
    m = httpx.get(f"{serve_url}/v1/models/claude-sonnet-4-6").json()
    assert m["id"] == "claude-sonnet-4-6" and m["context_window"] == 32768 and m["max_output_tokens"] == 4096


def test_ready_only_with_every_engine_answering(serve_url, serve_config):
    """/health (and /health/ready) asks each engine deployment (the 8K and the 32K engine here) for vLLM's own
    health check; /health/live only that the ingress answers."""
    from serve_app.service import engine_key
    from serve_app.settings import AppSettings

    settings = AppSettings.model_validate(serve_config["applications"][0]["args"])
    keys = {engine_key(m) for m in settings.models}
    assert len(keys) == 2
    for path in ("/health", "/health/ready"):
        r = httpx.get(f"{serve_url}{path}", timeout=30)
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "ready", "engines": {k: "ok" for k in sorted(keys)}}
    live = httpx.get(f"{serve_url}/health/live", timeout=30)
    assert live.status_code == 200 and live.json()["status"] == "ok"


def test_a_model_id_containing_a_slash_is_served(client, serve_url):
    r = httpx.get(f"{serve_url}/v1/models/{SLASHED}", timeout=60)
    assert r.status_code == 200, r.text[:300]
    m = r.json()
    assert m["id"] == SLASHED and m["object"] == "model" and m["parent"] == MODEL
    assert client.models.retrieve(SLASHED).id == SLASHED  # the SDK sends the slash as %2F
    a = httpx.get(f"{serve_url}/v1/models/{SLASHED}", headers={"anthropic-version": "2023-06-01"}, timeout=60)
    assert a.status_code == 200 and a.json()["id"] == SLASHED and a.json()["type"] == "model"
    assert SLASHED in {m.id for m in client.models.list().data}
    r = ask(client, "anything", model=SLASHED, max_tokens=20, extra_body={"nvext": {"forced_script": "slash ok"}})
    assert r.model == SLASHED
    assert r.choices[0].message.content == "slash ok" and r.choices[0].finish_reason == "stop"


def _running(engine_handles) -> int:
    total = 0
    for h in engine_handles.values():
        total += h.num_unfinished.remote().result(timeout_s=30)
    return total


def test_disconnect_mid_stream_aborts_the_engine_request(serve_url, engine_handles):
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "Tell a very long story."}],
            "max_tokens": 2000, "temperature": 0, "nvext": {"forced_script": "story " * 1500}}

    async def start_and_drop():
        async with httpx.AsyncClient(timeout=120) as c:
            async with c.stream("POST", f"{serve_url}/v1/chat/completions", json=body) as resp:
                seen = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        seen += 1
                        if seen >= 5:
                            break  # leaving the block closes the connection mid-stream

    asyncio.run(start_and_drop())
    deadline = time.monotonic() + 30
    while _running(engine_handles) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _running(engine_handles) == 0


def test_the_engine_replica_times_its_first_token(engine_handles):
    """The replica's first-token account (the request log's `engine_ms`) comes from vLLM's own per-request stats:
    every step timed, none negative, prefill included."""
    from serve_app.engine.types import EngineRequest

    handle = next(iter(engine_handles.values()))
    req = EngineRequest(request_id=f"first-chunk-{time.time_ns()}", prompt_token_ids=list(range(1000, 1300)),
                        max_tokens=4, temperature=0)
    chunks = list(handle.options(stream=True).generate.remote(req))
    timed = [c.engine_ms for c in chunks if c.engine_ms is not None]
    assert len(timed) == 1 and chunks[1].engine_ms is not None  # on the first token's chunk (0 is acceptance)
    assert list(timed[0]) == ["handoff", "queued", "prefill", "out"], timed
    assert all(v >= 0 for v in timed[0].values()), timed
    assert sum(c.finish_reason is not None for c in chunks) == 1 and sum(len(c.token_ids) for c in chunks) == 4


def test_a_tool_message_answering_no_call_is_refused(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "list"}, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_9", "content": "a.py"}])
    assert e.value.body["message"] == ("Invalid parameter: 'tool_call_id' of 'call_9' not found in 'tool_calls' "
                                       "of previous message.")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}])
    assert e.value.body["param"] == "messages.0"


def test_logit_bias_and_penalties_reach_the_engine(client, serve_url):
    bang = httpx.post(f"{serve_url}/v1/tokenize", json={"model": MODEL, "prompt": "!", "add_special_tokens": False},
                      timeout=60).json()["tokens"]
    assert len(bang) == 1
    r = ask(client, "What is the capital of France?", max_tokens=5, logit_bias={str(bang[0]): 100},
            frequency_penalty=0.0, presence_penalty=0.0)
    assert r.choices[0].message.content == "!!!!!"  # +100 on one token: greedy picks it every step
