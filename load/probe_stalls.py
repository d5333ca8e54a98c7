"""When in a round the long inter-token gaps happen, for this app through the front door, this app straight to
its ingress replica, and vLLM's server, alternating round by round in one run (tiny model, as bench_capacity).

bench_capacity's ITL p99 at 128 streams moves 1.7x-6x vLLM's between runs of the same code; this probe says
whether the long gaps sit in the admission burst (every stream of a round starts at once, so until the last
stream's first token the server is still parsing, rendering and admitting requests while it streams the first
ones) or are spread over the steady streaming after it, and which path has them.

    python -m load.probe_stalls --rounds 4 --json load/results/stalls.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from load.bench_capacity import (MODEL_ID, PY, SETTLE_S, add_engine_placement_arg, free_port, git_commit, host, pct,
                                 replica_http_port, request_log, start_ours, start_vllm, stop, wait_healthy)
from load.tiny_model import ensure_tiny_model

LONG_GAP_S = 0.1  # vLLM's ITL p99 at 128 streams on these hosts is ~40-150 ms


async def _stream(session: aiohttp.ClientSession, url: str, prompt: str, tokens: int, t0: float) -> dict:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    first = last = None
    gaps: list[tuple[float, float]] = []  # (when the gap ended, seconds from the round's start; its length)
    sent = time.time()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if b'"content":"' not in line or b'"content":""' in line:
                continue
            now = time.perf_counter() - t0
            if first is None:
                first, first_wall = now, time.time()
            else:
                gaps.append((now, now - last))
            last = now
    return {"prompt": prompt, "sent": sent, "first": first, "first_wall": first_wall, "gaps": gaps}


async def _round(url: str, c: int, tokens: int, seed: int) -> list[dict]:
    prompts = [f"[{seed}.{i}] Write a story about the number {seed * 7919 + i}." for i in range(c)]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1800)) as session:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(_stream(session, url, p, tokens, t0) for p in prompts)))


def summarize(streams: list[dict]) -> dict:
    admitted = max(s["first"] for s in streams)  # the last stream's first token: the admission burst is over
    gaps = [g for s in streams for g in s["gaps"]]
    during = [d for t, d in gaps if t - d < admitted]  # gaps that began before the last first token
    after = [d for t, d in gaps if t - d >= admitted]
    long_ = [(t, d) for t, d in gaps if d >= LONG_GAP_S]
    return {
        "admission_s": round(admitted, 3),
        "ttft_p50_ms": round(1000 * pct([s["first"] for s in streams], 0.5), 1),
        "itl_p99_ms": round(1000 * pct([d for _, d in gaps], 0.99), 1),
        "itl_p99_during_admission_ms": round(1000 * pct(during, 0.99), 1),
        "itl_p99_after_admission_ms": round(1000 * pct(after, 0.99), 1),
        "gaps_during_admission": len(during),
        "gaps_after_admission": len(after),
        "long_gaps": len(long_),
        "long_gaps_during_admission": sum(1 for t, d in long_ if t - d < admitted),
        "longest_gap_ms": round(1000 * max(d for _, d in gaps), 1),
        # Long gaps by the second of the round they ended in: a stall shared by all streams is one column.
        "long_gaps_by_second": {str(k): v for k, v in sorted(_by_second(long_).items())},
    }


def ttft_split(streams: list[dict], log: dict[str, dict]) -> dict:
    """Where each request's client TTFT went, from the request log's line for it (matched by its prompt text):
    before the app (client send -> ASGI entry: the connection, the front door, the replica's HTTP server and
    Serve's per-request wrapper), inside the app (ASGI entry -> first token at the ingress: the log's ttft_s) and
    after (that first token -> the client reading its frame)."""
    before, inside, after = [], [], []
    for s in streams:
        rec = log.get(s["prompt"])
        if not rec or rec.get("ttft_s") is None or rec.get("duration_s") is None:
            continue
        arrived = rec["ts"] - rec["duration_s"]
        before.append(arrived - s["sent"])
        inside.append(rec["ttft_s"])
        after.append(s["first_wall"] - arrived - rec["ttft_s"])
    return {"matched": len(before), **{f"{k}_p50_ms": round(1000 * pct(v, 0.5), 1) for k, v in
                                       (("before_app", before), ("in_app", inside), ("after_app", after))},
            **{f"{k}_p90_ms": round(1000 * pct(v, 0.9), 1) for k, v in
               (("before_app", before), ("in_app", inside), ("after_app", after))}}


def _by_second(gaps: list[tuple[float, float]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t, _ in gaps:
        out[int(t)] = out.get(int(t), 0) + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    add_engine_placement_arg(ap, default="ingress")
    ap.add_argument("--json")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = ensure_tiny_model()
    log = open(tempfile.mkstemp(prefix="probe_stalls_", suffix=".log")[1], "w")
    ports = {"ours": free_port(), "vllm": free_port()}
    procs = [start_ours(ports["ours"], model, 1, log, {}, engine_placement=a.engine_placement,
                        ingress_set={"log_request_text": True}),  # to match the request log's lines to requests
             start_vllm(ports["vllm"], model, log)]
    try:
        wait_healthy(f"http://127.0.0.1:{ports['ours']}", procs[0])
        wait_healthy(f"http://127.0.0.1:{ports['vllm']}", procs[1])
        urls = {"ours_front_door": f"http://127.0.0.1:{ports['ours']}",
                "ours_replica": f"http://127.0.0.1:{replica_http_port(ports['ours'])}",
                "vllm": f"http://127.0.0.1:{ports['vllm']}"}
        for url in urls.values():  # warm-up
            asyncio.run(_round(url, 8, 16, seed=-1))
        rounds: dict[str, list[dict]] = {n: [] for n in urls}
        raw: dict[str, list[list[dict]]] = {n: [] for n in urls}
        names = list(urls)
        for r in range(a.rounds):
            for n in names[r % 3:] + names[:r % 3]:  # rotate the order so no path always follows another
                time.sleep(SETTLE_S)
                raw[n].append(asyncio.run(_round(urls[n], a.concurrency, a.tokens, seed=r * 10 + names.index(n))))
                rounds[n].append(summarize(raw[n][-1]))
                print(f"round {r} {n}: {json.dumps(rounds[n][-1])}", flush=True)
        time.sleep(3)  # Ray forwards the replica's stdout (the request log) with a short delay
        log.flush()
        lines = {rec["text"]: rec for rec in request_log(log.name) if "text" in rec}
        for n in ("ours_front_door", "ours_replica"):
            for row, streams in zip(rounds[n], raw[n]):
                row["ttft_split"] = ttft_split(streams, lines)
        out = {"command": " ".join([Path(PY).name, "-m", "load.probe_stalls", *sys.argv[1:]]),
               "commit": git_commit(), "host": host(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
               "concurrency": a.concurrency, "tokens_per_request": a.tokens, "engine_placement": a.engine_placement,
               "long_gap_s": LONG_GAP_S, "rounds": rounds}
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
