"""What the hop in front of the ingress costs: the same requests to this app through Serve's front door (HAProxy in
direct-ingress mode, the port clients use) and straight to the ingress replica's own HTTP port, alternating, one at
a time, on the tiny model (`load/tiny_model.py`).

The request log's phases (`http` at the ASGI entry … `first_frame` when the first token's frame is handed to the
server) cover the time inside the ingress; what the client sees beyond them is the way in and out of the replica.
This probe splits that remainder into the front door's share (front door minus direct) and the rest (the replica's
HTTP server and the client, present for vLLM's server too).

    python -m load.probe_ingress_hop --json load/results/ingress_hop.json
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

from load import provenance
from load.bench_capacity import (free_port, one_stream, pct, replica_http_port,
                                 request_phases, start_ours, stop, wait_healthy)

ROOT = Path(__file__).resolve().parents[1]


async def alternate(urls: dict[str, str], n: int, tokens: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {k: [] for k in urls}
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            for name in (list(urls) if i % 2 == 0 else list(urls)[::-1]):
                res = await one_stream(session, urls[name], f"probe {i}: count to ten", tokens)
                res["t_end"] = time.time()
                out[name].append(res)
                await asyncio.sleep(0.05)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=60, help="per path")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json")
    a = ap.parse_args()
    from load.tiny_model import ensure_tiny_model

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log = open(tempfile.mkstemp(prefix="probe_ingress_hop_", suffix=".log")[1], "w")
    front = free_port()
    proc = start_ours(front, ensure_tiny_model(), 1, log, {})
    try:
        wait_healthy(f"http://127.0.0.1:{front}", proc)
        direct = replica_http_port(front)
        urls = {"front_door": f"http://127.0.0.1:{front}", "direct": f"http://127.0.0.1:{direct}"}
        asyncio.run(alternate(urls, 4, a.tokens))  # warm-up
        t0 = time.time()
        runs = asyncio.run(alternate(urls, a.requests, a.tokens))
        log.flush()
        phases = [r for r in request_phases(log.name) if r["ts"] >= t0]
        inside = sorted(sum(v for k, v in p["phases_ms"].items() if not k.startswith("engine_")) for p in phases)
        result = {
            **provenance.header("load.probe_ingress_hop", sys.argv[1:]),
            "tokens_per_request": a.tokens, "requests_per_path": a.requests,
            "ttft_ms": {k: {"p50": round(pct([r["ttft"] for r in v], 0.5) * 1000, 2),
                            "p90": round(pct([r["ttft"] for r in v], 0.9) * 1000, 2)} for k, v in runs.items()},
            # per request, ASGI entry to the first token's frame handed to the server (both paths' requests)
            "inside_ingress_ms": {"requests": len(inside), "p50": round(pct(inside, 0.5), 2),
                                  "p90": round(pct(inside, 0.9), 2)},
        }
        t = result["ttft_ms"]
        result["front_door_share_ms_p50"] = round(t["front_door"]["p50"] - t["direct"]["p50"], 2)
        print(json.dumps(result, indent=1))
        if a.json:
            provenance.write(a.json, result, indent=1)
    finally:
        stop([proc])


if __name__ == "__main__":
    main()
