"""Late first tokens after idle: one request at a time, after idle gaps of several lengths, to this app and to
vLLM's own server (the capacity bench's tiny model and settings, load/bench_capacity.py), alternating.

For each of our requests the request log's `phases_ms` and `engine_ms` (serve_app/request_log.py) are joined to
the client's TTFT by request id, so a slow first token says where it waited: before the engine replica
(`accept`), inside it (`engine_*`: the handoff to vLLM's engine core, its queue, prefill, the way back to the
replica) or between the replica and the ingress (`first_token` minus the engine's part). Then, per server, the
CPU each role burns in the two seconds after a request ends (`cpu_after_request`). docs/serving-path.md, "First
tokens that arrive late", reads the result.

    python -m load.probe_first_token --json load/results/first_token_probe.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time

import aiohttp

from load import provenance
from load.bench_capacity import (MODEL_ID, CpuMeter, free_port, pct, request_log, start_ours,
                                 start_vllm, stop, wait_healthy)

GAPS_S = (0.0, 0.5, 2.0, 5.0, 10.0)


async def one(url: str, prompt: str, tokens: int) -> dict:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, rid = None, None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        async with s.post(url + "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                if rid is None:
                    rid = json.loads(line[6:])["id"]
                if ttft is None and b'"content":"' in line and b'"content":""' not in line:
                    ttft = time.perf_counter() - t0
    return {"ttft_ms": round(1000 * (ttft or 0.0), 2), "id": rid}


def cpu_after_request(url: str, meter: CpuMeter, tokens: int, window_s: float = 2.0, step_s: float = 0.1) -> dict:
    """CPU seconds per role in each `step_s` slice after one request ends (the server otherwise idle): what a
    server keeps burning once its work is done, which on shared cores the other server's engine pays for."""
    time.sleep(3)
    asyncio.run(one(url, "Count to ten.", tokens))
    prev, slices = meter.snapshot(), []
    for _ in range(int(window_s / step_s)):
        time.sleep(step_s)
        cur = meter.snapshot()
        slices.append({k: round(v, 3) for k, v in CpuMeter.delta(prev, cur).items() if v >= 0.005})
        prev = cur
    busy = [i for i, s in enumerate(slices) if s.get("engine_core", 0.0) >= 0.5 * step_s]
    return {"step_s": step_s, "engine_core_busy_s": round(step_s * (busy[-1] + 1), 2) if busy else 0.0,
            "slices": slices}


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": round(pct(values, 0.5), 2), "p90_ms": round(pct(values, 0.9), 2),
            "max_ms": round(max(values), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=4, help="passes over the idle gaps (shuffled each pass)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()

    from load.tiny_model import ensure_tiny_model

    model_path = ensure_tiny_model()
    log = open(tempfile.mkstemp(prefix="probe_first_token_", suffix=".log")[1], "w")
    print(f"server logs: {log.name}", flush=True)
    ports = {"ours": free_port(), "vllm": free_port()}
    procs = {"ours": start_ours(ports["ours"], model_path, 1, log, {}), "vllm": start_vllm(ports["vllm"], model_path, log)}
    try:
        urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
        for n in urls:
            wait_healthy(urls[n], procs[n])
        rng = random.Random(7)
        samples: list[dict] = []
        for r in range(a.repeat):
            gaps = list(GAPS_S)
            rng.shuffle(gaps)
            for g in gaps:
                for n in (("ours", "vllm") if r % 2 == 0 else ("vllm", "ours")):
                    time.sleep(g)  # each server idles g seconds before its request
                    res = asyncio.run(one(urls[n], f"[{rng.random():.9f}] Count to ten.", a.tokens))
                    samples.append({"server": n, "pass": r, "idle_s": g, **res})
                    print(f"pass {r} idle {g:>4} s {n}: TTFT {res['ttft_ms']:.1f} ms", flush=True)
        meters = {n: CpuMeter(procs[n].pid, n) for n in ports}
        after = {n: [cpu_after_request(urls[n], meters[n], a.tokens) for _ in range(2)] for n in ports}
        for n, runs in after.items():
            print(f"{n}: engine core busy for {[r['engine_core_busy_s'] for r in runs]} s after a request", flush=True)
        time.sleep(3)  # Ray forwards the replicas' stdout with a short delay
        log.flush()
        records = {rec.get("request_id"): rec for rec in request_log(log.name)}
        for s in samples:
            rec = records.get((s["id"] or "").removeprefix("chatcmpl-")) if s["server"] == "ours" else None
            if rec:
                s["phases_ms"], s["engine_ms"] = rec.get("phases_ms"), rec.get("engine_ms")
        ttft = {n: [s["ttft_ms"] for s in samples if s["server"] == n] for n in ports}
        out = {
            **provenance.header("load.probe_first_token", sys.argv[1:]),
            "tokens_per_request": a.tokens, "idle_gaps_s": list(GAPS_S), "repeat": a.repeat,
            "ttft": {n: summary(v) for n, v in ttft.items()},
            "cpu_after_request": after,
            "ours_slowest": sorted((s for s in samples if s["server"] == "ours"), key=lambda s: -s["ttft_ms"])[:5],
            "samples": samples,
        }
        print(json.dumps({k: out[k] for k in ("ttft", "ours_slowest")}, indent=2))
        if a.json:
            provenance.write(a.json, out)
    finally:
        stop(list(procs.values()))


if __name__ == "__main__":
    main()
