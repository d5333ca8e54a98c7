"""TTFT of new sessions and replayed turns: what prefix stability is worth (issue: prompt pipeline).

Against a running server (`serve run config.yaml`, the long-context default model), all through the real APIs:

  prefix cases (Anthropic Messages, a ~16K-token system prompt, each request a new session):
    (a) identical       every session sends the same system prompt (only the user turn differs)
    (b) attribution     a per-session line sits in the first system block and survives templating, as with
                        preamble stripping off: sent as a line the stripper does not recognise, unless
                        `--url-nostrip` names a second server started with `ingress.strip_preamble: false`,
                        which then gets the real `x-anthropic-billing-header` line
    (c) stripped        the real per-session `x-anthropic-billing-header: cc_version=…; cc_entrypoint=cli;`
                        line, stripped by the server before templating
  replay cases (Chat Completions, `reasoning_content` + tool calls in the history, a new session each):
    kept                turn k+1 replays turns 1..k exactly as they were sent (the prefix is in the KV cache)
    altered             the same, but the first assistant turn's reasoning comes back altered (trimmed and
                        reworded, as a proxy that rewrites thinking does), so everything after it is prefilled

TTFT = request sent → first streamed output event. Prints p50/p95 per case and the ratios beside the published
B200 ratios (912/168 ms ≈ 5.4× for the attribution line, 322/167 ms ≈ 1.9× for altered reasoning).

    python -m load.bench_ttft --url http://127.0.0.1:8000 --model smollm2-135m-instruct-32k [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from typing import Any

import httpx

from load import provenance

PUBLISHED = {"attribution": (912.0, 168.0), "reasoning": (322.0, 167.0)}  # B200, 52K-token prompts, ms

_WORDS = ("the build step reads each module and its tests before the agent edits any file in the repository "
          "so that a change to one function is checked against every caller that imports it while the "
          "harness keeps a log of commands outputs and diffs for the reviewer to inspect later on").split()


def filler(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    lines, line = [], []
    for i in range(n_words):
        line.append(rng.choice(_WORDS))
        if len(line) >= 14:
            lines.append(" ".join(line) + ".")
            line = []
    if line:
        lines.append(" ".join(line) + ".")
    return "\n".join(lines)


def billing_line(session: int) -> str:
    h = hashlib.sha256(f"session-{session}".encode()).hexdigest()
    return f"x-anthropic-billing-header: cc_version=2.1.197.{h[:3]}; cc_entrypoint=cli;"


def unrecognised_line(session: int) -> str:
    """The billing line's per-session fields in the same place, under a name the stripper does not remove."""
    return "x-anthropic-attribution:" + billing_line(session)[len("x-anthropic-billing-header:"):]


class Client:
    def __init__(self, url: str, model: str, api_key: str, timeout: float):
        self.last_cached = 0  # prompt tokens the engine found in its prefix cache, for the last request
        self.url = url.rstrip("/")
        self.model = model
        self.http = httpx.Client(timeout=timeout, headers={"x-api-key": api_key, "authorization": f"Bearer {api_key}"})

    def count(self, system: str) -> int:
        r = self.http.post(f"{self.url}/v1/tokenize", json={
            "model": self.model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": "x"}]})
        r.raise_for_status()
        return r.json()["count"]

    def anthropic_ttft(self, system: list[dict[str, Any]], user: str, max_tokens: int = 4) -> float:
        body = {"model": self.model, "max_tokens": max_tokens, "stream": True, "system": system,
                "messages": [{"role": "user", "content": user}]}
        return self._ttft(f"{self.url}/v1/messages", body, anthropic=True)

    def chat_ttft(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], max_tokens: int = 4) -> float:
        body = {"model": self.model, "max_tokens": max_tokens, "stream": True, "messages": messages, "tools": tools,
                "temperature": 0, "stream_options": {"include_usage": True}}
        return self._ttft(f"{self.url}/v1/chat/completions", body, anthropic=False)

    def _ttft(self, url: str, body: dict[str, Any], *, anthropic: bool) -> float:
        t0 = time.perf_counter()
        first: float | None = None
        with self.http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                usage = ev.get("usage") if isinstance(ev.get("usage"), dict) else None
                if usage:
                    self.last_cached = (usage.get("cache_read_input_tokens")
                                        or (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                if anthropic:
                    # message_start comes before prefill; the first delta (or the stop, if the model ends at
                    # once) is the first thing the engine produced.
                    hit = ev.get("type") in ("content_block_delta", "message_delta")
                    if ev.get("type") == "error":
                        raise RuntimeError(f"stream error: {ev}")
                else:
                    ch = (ev.get("choices") or [{}])[0]
                    d = ch.get("delta") or {}
                    hit = bool(d.get("content") or d.get("reasoning_content") or d.get("tool_calls")
                               or ch.get("finish_reason"))
                if hit and first is None:
                    first = time.perf_counter()
        return ((first or time.perf_counter()) - t0) * 1000.0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


CACHED: dict[str, list[int]] = {}  # per case: prompt tokens the engine reported as prefix-cache hits


def _take(out: dict[str, list[float]], name: str, client: Client, ttft: float) -> None:
    out.setdefault(name, []).append(ttft)
    CACHED.setdefault(name, []).append(client.last_cached)


def prefix_cases(c: Client, nostrip: Client | None, system: str, sessions: int, log) -> dict[str, list[float]]:
    big = {"type": "text", "text": system}
    intro = {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}
    c.anthropic_ttft([intro, big], "warm up")  # the shared system prompt is now cached
    if nostrip is not None:
        nostrip.anthropic_ttft([intro, big], "warm up")
    out: dict[str, list[float]] = {}
    base = 1000 * int(time.time() % 100000)  # fresh session ids per run: no cache left from an earlier run
    for i in range(sessions):
        s = base + i
        user = f"Session {s}: summarise the build rules."
        _take(out, "identical", c, c.anthropic_ttft([intro, big], user))
        if nostrip is not None:
            line = {"type": "text", "text": billing_line(s)}
            _take(out, "attribution", nostrip, nostrip.anthropic_ttft([line, intro, big], user))
        else:
            line = {"type": "text", "text": unrecognised_line(s)}
            _take(out, "attribution", c, c.anthropic_ttft([line, intro, big], user))
        _take(out, "stripped", c, c.anthropic_ttft([{"type": "text", "text": billing_line(s)}, intro, big], user))
        log(f"  session {i}: " + ", ".join(f"{k} {v[-1]:.0f} ms (cached {CACHED[k][-1]})" for k, v in out.items()))
    return out


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def history(session: int, turns: int, words: int, alter_first: bool = False) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": f"Session {session}: fix the failing test."}]
    for t in range(turns):
        reasoning = f"Turn {t}: " + filler(words, seed=session * 100 + t)
        if alter_first and t == 0:
            reasoning = reasoning.strip().replace("the ", "a ", 3)
        msgs.append({"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [{
            "id": f"call_{session}_{t}", "type": "function",
            "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/mod_{t}.py"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{session}_{t}",
                     "content": filler(words // 2, seed=session * 100 + t + 50)})
    return msgs


def replay_cases(c: Client, system: str, sessions: int, turns: int, words: int, log) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    sys_msg = {"role": "system", "content": system}
    base = 1000 * int(time.time() % 100000) + 500
    for i in range(sessions):
        for case in ("kept", "altered"):
            s = base + 2 * i + (case == "altered")
            c.chat_ttft([sys_msg, *history(s, turns - 1, words)], TOOLS, max_tokens=1)  # turn k: now cached
            nxt = [sys_msg, *history(s, turns, words, alter_first=case == "altered")]
            _take(out, case, c, c.chat_ttft(nxt, TOOLS))
        log(f"  session {i}: " + ", ".join(f"{k} {v[-1]:.0f} ms (cached {CACHED[k][-1]})" for k, v in out.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--url-nostrip", default=None, help="a second server with ingress.strip_preamble: false")
    ap.add_argument("--model", default="smollm2-135m-instruct-32k")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--system-tokens", type=int, default=16000)
    ap.add_argument("--sessions", type=int, default=5)
    ap.add_argument("--turns", type=int, default=6, help="assistant turns in the replayed history")
    ap.add_argument("--turn-words", type=int, default=300, help="words of reasoning per replayed turn")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    c = Client(a.url, a.model, a.api_key, a.timeout)
    nostrip = Client(a.url_nostrip, a.model, a.api_key, a.timeout) if a.url_nostrip else None
    words = a.system_tokens  # calibrated below: the filler runs about one token per word
    system = filler(words, seed=7)
    n = c.count(system)
    system = filler(max(1, int(words * a.system_tokens / n)), seed=7)
    n = c.count(system)
    log(f"system prompt: {n} tokens ({a.model} at {a.url})")

    results: dict[str, Any] = {**provenance.header("load.bench_ttft", sys.argv[1:] if argv is None else argv),
                               "url": a.url, "model": a.model, "system_prompt_tokens": n, "sessions": a.sessions,
                               "cases": {}}
    log("prefix cases (new sessions):")
    samples = prefix_cases(c, nostrip, system, a.sessions, log)
    log("replay cases (multi-turn, reasoning kept vs altered):")
    samples.update(replay_cases(c, system, a.sessions, a.turns, a.turn_words, log))
    for name, xs in samples.items():
        results["cases"][name] = {"p50_ms": statistics.median(xs), "p95_ms": _pct(xs, 0.95), "samples_ms": xs,
                                  "cached_tokens": CACHED.get(name, [])}
    p50 = {k: v["p50_ms"] for k, v in results["cases"].items()}
    results["ratios"] = {
        "attribution_vs_stripped": p50["attribution"] / p50["stripped"],
        "attribution_vs_identical": p50["attribution"] / p50["identical"],
        "altered_vs_kept": p50["altered"] / p50["kept"],
        "published_b200_attribution": PUBLISHED["attribution"][0] / PUBLISHED["attribution"][1],
        "published_b200_reasoning": PUBLISHED["reasoning"][0] / PUBLISHED["reasoning"][1],
    }
    results["attribution_mode"] = "second server, strip off" if nostrip else "unrecognised per-session line"

    print(f"\n{'case':<14}{'p50 ms':>10}{'p95 ms':>10}{'cached tokens (median)':>26}")
    for name, v in results["cases"].items():
        print(f"{name:<14}{v['p50_ms']:>10.0f}{v['p95_ms']:>10.0f}{statistics.median(v['cached_tokens'] or [0]):>26.0f}")
    r = results["ratios"]
    print(f"\nattribution line, stripping off vs on: {r['attribution_vs_stripped']:.2f}x "
          f"(published B200: {r['published_b200_attribution']:.1f}x)")
    print(f"replayed reasoning altered vs kept:    {r['altered_vs_kept']:.2f}x "
          f"(published B200: {r['published_b200_reasoning']:.1f}x)")
    if a.json:
        provenance.write(a.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
