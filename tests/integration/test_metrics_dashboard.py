"""The Grafana dashboard against the running service (the session server): after a little traffic through each
API and one tenant's 429, every panel's query selects samples from the service's `/metrics` (the node's Ray
metrics agent: the app's metrics and vLLM's engine metrics), with the labels the panel groups by.

The structure and names are checked without a server in tests/unit/test_dashboard.py.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from serve_app import metrics
from tests.support.prometheus import grouping_labels, matching, samples, selectors

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "kuberay" / "monitoring" / "grafana-dashboard.json").read_text())
MODEL = "smollm2-135m-instruct"
SCRIPT = "one two three four five six"
# Ray's agents report a replica's metrics every few seconds (metrics_report_interval_ms, 10 s by default).
EXPORT_WAIT_S = 90
REQUESTS = metrics.RAY_EXPORT_PREFIX + metrics.PREFIX + "requests_total"
CACHED = metrics.RAY_EXPORT_PREFIX + metrics.PREFIX + "cached_tokens_total"
DASHBOARD_KEY, DASHBOARD_TENANT = "sk-test-dashboard", "dashboard"  # tests/configs/test.yaml


def _scrape(url: str):
    r = httpx.get(f"{url}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:500]
    return samples(r.text)


def _generated(scraped) -> float:
    """vLLM's generated-token counter, whichever suffix the exporter gives it."""
    return sum(_total(scraped, n) for n in ("ray_vllm_generation_tokens_total", "ray_vllm_generation_tokens"))


def _total(scraped, name: str, **labels) -> float:
    return sum(v for n, ls, v in scraped if n == name and all(ls.get(k) == x for k, x in labels.items()))


def _missing(scraped) -> list[str]:
    out = []
    for panel in DASHBOARD["panels"]:
        for target in panel.get("targets", []):
            need = grouping_labels(target["expr"])
            for sel in selectors(target["expr"]):
                hits = [s for s in matching(scraped, sel) if need <= s[1].keys()]
                if not hits:
                    out.append(f"{panel['title']}: {sel.name} {[(m.label, m.op, m.value) for m in sel.matchers]}")
    return out


def _traffic(url: str) -> int:
    """One stream per API, a repeated long prompt (cached tokens), a 429 for a concurrency-limited tenant.
    Returns how many chat requests answered 200 for the test's own tenant."""
    forced = {"nvext": {"forced_script": SCRIPT}}
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)
    with claude.messages.stream(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "hi"}],
                                extra_body=forced) as s:
        assert SCRIPT in "".join(s.text_stream)
    # A tenant of this test's own: the default tenant's counter also takes other modules' requests, which Ray
    # exports up to ~10 s late, so counting this test's requests there was a race (a load test's stragglers).
    oai = openai.OpenAI(base_url=f"{url}/v1", api_key=DASHBOARD_KEY, max_retries=0, timeout=300)
    chunks = list(oai.chat.completions.create(model=MODEL, max_tokens=16, stream=True, extra_body=forced,
                                              messages=[{"role": "user", "content": "hi"}]))
    assert chunks
    events = list(oai.responses.create(model=MODEL, max_output_tokens=16, stream=True, input="hi", store=False,
                                       extra_body=forced))
    assert events[-1].type == "response.completed"
    # ~600 tokens, fresh each run, sent twice: the second finds the first's blocks in the prefix cache.
    rng = random.Random(uuid.uuid4().int)
    long = " ".join(rng.choice("metric panel scrape replica engine cache token".split()) for _ in range(600))
    for _ in range(2):
        oai.chat.completions.create(model=MODEL, max_tokens=2, extra_body={"nvext": {"forced_script": "ok"}},
                                    messages=[{"role": "user", "content": long}])
    limited = anthropic.Anthropic(base_url=url, api_key="sk-test-one-at-a-time", max_retries=0, timeout=300)
    with limited.messages.stream(model=MODEL, max_tokens=200, messages=[{"role": "user", "content": "go"}],
                                 extra_body={"nvext": {"forced_script": "word " * 150}}) as running:
        next(iter(running))  # the tenant's one slot is taken
        with pytest.raises(anthropic.RateLimitError):
            limited.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "me too"}])
        running.until_done()
    return 3  # the chat stream and the two long-prompt requests


def test_every_dashboard_panel_has_data_after_traffic(serve_url):
    before = _scrape(serve_url)
    chat_ok = dict(api="chat", status="200", tenant=DASHBOARD_TENANT)
    chat_before = _total(before, REQUESTS, **chat_ok)
    cached_before = _total(before, CACHED, api="chat")
    generated_before = _generated(before)
    sent = _traffic(serve_url)

    deadline = time.monotonic() + EXPORT_WAIT_S
    while True:
        scraped = _scrape(serve_url)
        missing = _missing(scraped)
        counted = _total(scraped, REQUESTS, **chat_ok) - chat_before
        # vLLM's per-step counters reach Ray through the metrics buffer (engine/stat_logger.py): they arrive too.
        generated = _generated(scraped) - generated_before
        if not missing and counted >= sent and generated > 0:
            break
        if time.monotonic() > deadline:
            names = sorted({n for n, _, _ in scraped if n.startswith(("ray_serve_app", "ray_vllm"))})
            pytest.fail(f"after {EXPORT_WAIT_S}s: panels without data {missing}; chat requests counted {counted} "
                        f"of {sent}; engine tokens counted {generated}; exported: {names}")
        time.sleep(3)

    # Each request is counted once (one registry, not a copy per backend), by API, status and tenant; no other
    # test sends as this tenant.
    assert counted == sent
    assert _total(scraped, REQUESTS, api="anthropic", status="429", tenant="one-at-a-time") >= 1
    assert _total(scraped, CACHED, api="chat") - cached_before > 0
    for api in ("anthropic", "chat", "responses"):
        assert _total(scraped, metrics.RAY_EXPORT_PREFIX + metrics.PREFIX + "ttft_seconds_count", api=api) >= 1
        assert _total(scraped, metrics.RAY_EXPORT_PREFIX + metrics.PREFIX + "inter_token_seconds_count",
                      api=api) >= 1
    # vLLM's engine metrics come one series per engine replica, named by the replica id the router uses.
    kv = [ls for n, ls, _ in scraped if n == "ray_vllm_kv_cache_usage_perc"]
    assert kv and all(ls.get("ReplicaId") for ls in kv)
    assert {ls["model_name"] for ls in kv} >= {MODEL}
    # ... all of them but the one vLLM records per generated token (serve_app/engine/stat_logger.py): the
    # engine's own TTFT is there, its inter-token histogram never observes (the ingress's above stands in).
    assert _total(scraped, "ray_vllm_time_to_first_token_seconds_count") >= 1
    assert _total(scraped, "ray_vllm_inter_token_latency_seconds_count") == 0
