"""Tenant scheduling tiers and fair shares under saturation, side by side in one run: a `ci` tenant keeps the
engine's queue full of long streams while a `dev` tenant sends short requests one after another. Run three times on
the same server config: with tiers (`ci` priority -10, `dev` 10; serve_app/tenants.py `engine_priority`); in one
tier with fair shares (both 0, `ingress.fair_share`, the default; serve_app/engine/fair_share.py); and in one tier
first come, first served (`fair_share: false`, what vLLM's own queue does). The dev requests' time to first token
(the request log's `ttft_s`, from arrival at the ingress) is the figure, with the ci tenant's output tokens/s
beside it (both should reorder the queue, not shrink the work done).

The frontend-bound tiny model (load/tiny_model.py, random weights) on `python -m serve_app run --single-process`,
config.yaml's topology, with `max_num_seqs` small so that requests wait inside vLLM, where priority acts.

    python -m load.bench_tiers --json load/results/tiers.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from load import provenance
from load.bench_capacity import MODEL_ID, free_port, ours_config, pct, request_log, start_server, stop, wait_healthy
from load.tiny_model import ensure_tiny_model

TIERS = {"tiered": {"ci": -10, "dev": 10}, "fair": {"ci": 0, "dev": 0}, "flat": {"ci": 0, "dev": 0}}
FAIR_SHARE = {"tiered": True, "fair": True, "flat": False}
KEYS = {"ci": "sk-bench-ci", "dev": "sk-bench-dev"}


def config(port: int, model_path: str, tenants: dict[str, dict], max_num_seqs: int, fair_share: bool = True,
           keys: dict[str, str] = KEYS) -> dict:
    """The single-process server on the tiny model with `tenants` (name -> TenantConfig fields), each reached
    with its key of `keys`, and room for `max_num_seqs` running requests (the rest wait inside vLLM)."""
    cfg = ours_config(port, model_path, 1, engine_placement="ingress", front="listen", ingress_set={
        "api_keys": [{"key": keys[t], "tenant": t} for t in keys],
        "tenants": tenants,
        "fair_share": fair_share,
        "log_requests": True,
    })
    model = cfg["applications"][0]["args"]["models"][0]
    model["engine_kwargs"] = {**model["engine_kwargs"], "max_num_seqs": max_num_seqs}
    return cfg


async def stream(client: httpx.AsyncClient, key: str, tokens: int) -> int:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "go"}], "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    out = 0
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"completion_tokens"' in line:
                out = json.loads(line[6:])["usage"]["completion_tokens"]
    return out


async def load(url: str, a: argparse.Namespace) -> dict:
    """ci streams kept at `ci_streams` until the dev requests are done (each ci stream then ends its request);
    returns the ci tokens streamed over the whole run and how long it took, and how long the dev requests took."""
    done = asyncio.Event()
    ci_tokens = 0
    limits = httpx.Limits(max_connections=a.ci_streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def ci_worker() -> None:
            nonlocal ci_tokens
            while not done.is_set():
                n = await stream(client, KEYS["ci"], a.ci_tokens)
                ci_tokens += n  # not `+= await`: that reads the total before the wait, and the others' adds are lost

        begun = time.monotonic()
        workers = [asyncio.create_task(ci_worker()) for _ in range(a.ci_streams)]
        await asyncio.sleep(a.warmup_s)  # the queue fills
        started = time.monotonic()
        for _ in range(a.dev_requests):
            await stream(client, KEYS["dev"], a.dev_tokens)
            await asyncio.sleep(a.gap_s)
        elapsed = time.monotonic() - started
        done.set()
        await asyncio.gather(*workers)
        ci_s = time.monotonic() - begun
    return {"ci_tokens": ci_tokens, "ci_s": round(ci_s, 2), "dev_phase_s": round(elapsed, 2)}


def serve_and_load(name: str, cfg: dict, port: int, key: str, load_fn) -> tuple[Any, Path, float]:
    """The single-process server on `cfg` (listening on `port`) in a folder of its own, ready when it answers with
    `key`; `load_fn(url)` (a coroutine function) run against it, then the server stopped. Returns what the load
    returned, the server's log and the wall time the load began."""
    url = f"http://127.0.0.1:{port}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    (tmp / "config.yaml").write_text(yaml.safe_dump(cfg))
    log_path = tmp / "serve.log"
    with open(log_path, "w") as log:
        proc = start_server(tmp / "config.yaml", "single_process", log)
    try:
        wait_healthy(url, proc, headers={"authorization": f"Bearer {key}"})
        started = time.time()
        seen = asyncio.run(load_fn(url))
    finally:
        stop([proc])
    return seen, log_path, started


def run_variant(name: str, a: argparse.Namespace, model_path: str) -> dict:
    tenants = {t: {"priority": p} for t, p in TIERS[name].items()}
    port = free_port()
    cfg = config(port, model_path, tenants, a.max_num_seqs, FAIR_SHARE[name])
    seen, log_path, started = serve_and_load(f"tiers-{name}", cfg, port, KEYS["dev"], lambda url: load(url, a))
    # The load's requests: the readiness probe ended before `started`.
    rows = [r for r in request_log(log_path) if r.get("ts", 0) >= started and r.get("ttft_s") is not None]
    dev = [r["ttft_s"] for r in rows if r.get("tenant") == "dev"]
    ci = [r["ttft_s"] for r in rows if r.get("tenant") == "ci"]
    if len(dev) < a.dev_requests:
        raise RuntimeError(f"{name}: {len(dev)} dev requests in the request log, {a.dev_requests} sent")
    out = {"priorities": TIERS[name], "fair_share": FAIR_SHARE[name], "dev_requests": len(dev), "ci_requests": len(ci),
           "dev_ttft_p50_s": round(statistics.median(dev), 3), "dev_ttft_p95_s": round(pct(dev, 0.95), 3),
           "ci_ttft_p50_s": round(statistics.median(ci), 3) if ci else None,
           "ci_tokens_per_s": round(seen["ci_tokens"] / seen["ci_s"], 1), **seen}
    print(name, out, flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-num-seqs", type=int, default=2, help="the engine's running requests at most")
    ap.add_argument("--ci-streams", type=int, default=12, help="ci streams kept open at once")
    ap.add_argument("--ci-tokens", type=int, default=512, help="output tokens per ci request (ignore_eos)")
    ap.add_argument("--dev-requests", type=int, default=20)
    ap.add_argument("--dev-tokens", type=int, default=16)
    ap.add_argument("--gap-s", type=float, default=0.5, help="between one dev answer and the next dev request")
    ap.add_argument("--warmup-s", type=float, default=5.0, help="ci load before the first dev request")
    ap.add_argument("--json", help="write the result here")
    argv = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(argv)
    doc = provenance.header("load.bench_tiers", argv)
    model_path = ensure_tiny_model()
    variants = {name: run_variant(name, a, model_path) for name in TIERS}
    f = variants["flat"]

    def over_flat(v: dict) -> dict:
        return {
            "dev_ttft_p50": round(v["dev_ttft_p50_s"] / f["dev_ttft_p50_s"], 3),
            "dev_ttft_p95": round(v["dev_ttft_p95_s"] / f["dev_ttft_p95_s"], 3),
            "ci_tokens_per_s": round(v["ci_tokens_per_s"] / f["ci_tokens_per_s"], 3),
        }

    doc.update({
        "settings": {k: v for k, v in vars(a).items() if k != "json"},
        "variants": variants,
        "ratios_tiered_over_flat": over_flat(variants["tiered"]),
        "ratios_fair_over_flat": over_flat(variants["fair"]),
    })
    print(doc["ratios_tiered_over_flat"], doc["ratios_fair_over_flat"], flush=True)
    if a.json:
        provenance.write(a.json, doc)


if __name__ == "__main__":
    main()
