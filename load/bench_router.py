"""Router decision latency, capacity and overload fallback, and hashing speed, with 100K+ blocks indexed.

    python -m load.bench_router [--policy ttft] [--replicas 8] [--blocks-per-replica 12500] [--block-size 16]
                                [--prompt-tokens 32000] [--json load/results/router_bench.json]

Fills each replica's index (events mode) with distinct prompts, then
- times `RouterCore.choose` for prompts that match a prefix on one replica (the common agent case) and for
  unseen prompts, and `block_hashes` over the prompt (p50/p99 in microseconds);
- capacity: the Router does three things per request (choose, mark_prefilled, release); with 64 requests in
  flight it runs that cycle back to back for `--seconds` and reports requests per second of one core. This is
  the RouterCore's own cost; a Ray actor call adds its per-call overhead on top, not measured here;
- overload: above capacity the Router's queue grows, and the ingress stops waiting after `router_timeout_s`
  (0.5 s) and lets Serve pick the replica with the shortest queue (no cache awareness). Poisson arrivals at
  multiples of the measured capacity are replayed through one FIFO server whose service times are the measured
  per-request costs: the share of requests that would fall back and the p99 wait.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time

from serve_app.routing.core import RouteRequest, RouterCore
from serve_app.routing.hashing import block_hashes
from serve_app.routing.index import EVENTS


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def bench(replicas: int, blocks_per_replica: int, block_size: int, prompt_tokens: int, iters: int,
          policy: str = "ttft", seconds: float = 5.0, timeout_s: float = 0.5) -> dict:
    rng = random.Random(0)
    core = RouterCore(policy, block_size, seed=0)
    ids = [f"r{i}" for i in range(replicas)]
    core.sync_replicas(ids)
    prompt_blocks = prompt_tokens // block_size
    prompts: dict[str, list[list[int]]] = {}  # block hashes of the prompts each replica holds
    for rid in ids:
        core.set_mode(rid, EVENTS)
        prompts[rid] = []
        stored = 0
        while stored < blocks_per_replica:
            toks = [rng.randrange(150_000) for _ in range(prompt_blocks * block_size)]
            hashes = block_hashes(toks, block_size)
            core.blocks_stored(rid, hashes)
            prompts[rid].append(hashes)
            stored += len(hashes)
    indexed = core.index.total_blocks()

    def timed(make_req) -> list[float]:
        out = []
        for i in range(iters):
            req = make_req(i)
            t0 = time.perf_counter()
            core.choose(req)
            out.append(time.perf_counter() - t0)
            core.release(req.request_id)
        return out

    # A returning session: a cached prompt plus a new turn.
    hits = []
    for i in range(iters):
        rid = ids[i % replicas]
        cached = rng.choice(prompts[rid])
        turn = [rng.randrange(150_000) for _ in range(4 * block_size)]
        hashes = cached + block_hashes(turn, block_size, parent=cached[-1])
        hits.append(RouteRequest(f"h{i}", hashes, len(hashes) * block_size, 256))
    misses = []
    for i in range(iters):
        toks = [rng.randrange(150_000) for _ in range(prompt_blocks * block_size)]
        misses.append(RouteRequest(f"m{i}", block_hashes(toks, block_size), len(toks), 256))
    gc.collect()  # start from a clean heap, as a long-running Router is between requests
    t_hit = timed(lambda i: hits[i])
    t_miss = timed(lambda i: misses[i])
    cycle = capacity(core, hits + misses, seconds)
    per_s = len(cycle) / sum(cycle)

    toks = [rng.randrange(150_000) for _ in range(prompt_tokens)]
    t_hash = []
    for _ in range(max(5, iters // 20)):
        t0 = time.perf_counter()
        block_hashes(toks, block_size)
        t_hash.append(time.perf_counter() - t0)

    us = lambda xs, q: round(_pct(xs, q) * 1e6, 1)  # noqa: E731
    return {
        "policy": policy,
        "replicas": replicas,
        "block_size": block_size,
        "blocks_indexed": indexed,
        "prompt_tokens": prompt_tokens,
        "choose_hit_p50_us": us(t_hit, 0.5),
        "choose_hit_p99_us": us(t_hit, 0.99),
        "choose_miss_p50_us": us(t_miss, 0.5),
        "choose_miss_p99_us": us(t_miss, 0.99),
        "hash_prompt_p50_us": us(t_hash, 0.5),
        "hash_tokens_per_s": round(prompt_tokens / statistics.median(t_hash)),
        "requests_per_s_one_core": round(per_s),
        "request_cycle_p50_us": us(cycle, 0.5),
        "request_cycle_p99_us": us(cycle, 0.99),
        "overload": overload(cycle, per_s, timeout_s),
    }


def capacity(core: RouterCore, reqs: list[RouteRequest], seconds: float, inflight: int = 64) -> list[float]:
    """Per-request Router cost (choose + mark_prefilled + release), run back to back with `inflight` open."""
    open_ids: list[str] = []
    out: list[float] = []
    deadline = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < deadline:
        base = reqs[i % len(reqs)]
        req = RouteRequest(f"c{i}", base.block_hashes, base.num_prompt_tokens, base.expected_output_tokens,
                           f"s{i % 500}")
        t0 = time.perf_counter()
        core.choose(req)
        core.mark_prefilled(req.request_id)
        open_ids.append(req.request_id)
        if len(open_ids) > inflight:
            core.release(open_ids.pop(0))
        out.append(time.perf_counter() - t0)
        i += 1
    for rid in open_ids:
        core.release(rid)
    return out


def overload(service: list[float], capacity_per_s: float, timeout_s: float, n: int = 50_000) -> list[dict]:
    """Poisson arrivals at multiples of capacity through one FIFO server with the measured service times."""
    rng = random.Random(1)
    rows = []
    for factor in (0.5, 0.8, 0.95, 1.1, 1.5, 2.0):
        rate = factor * capacity_per_s
        t = free = 0.0
        waits = []
        for _ in range(n):
            t += rng.expovariate(rate)
            start = max(t, free)
            free = start + rng.choice(service)
            waits.append(free - t)
        waits.sort()
        rows.append({"offered_x_capacity": factor, "offered_per_s": round(rate),
                     "decision_p99_ms": round(waits[int(0.99 * n)] * 1e3, 2),
                     "fallback_share": round(sum(w > timeout_s for w in waits) / n, 4)})
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policy", default="ttft")
    p.add_argument("--seconds", type=float, default=5.0, help="capacity run length per block size")
    p.add_argument("--json", help="also write the results (with provenance) to this file")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--blocks-per-replica", type=int, default=12_500)
    p.add_argument("--block-size", type=int, action="append")
    p.add_argument("--prompt-tokens", type=int, default=32_000)
    p.add_argument("--iters", type=int, default=2000)
    a = p.parse_args(argv)
    results = []
    for bs in a.block_size or [16, 128]:
        results.append(bench(a.replicas, a.blocks_per_replica, bs, a.prompt_tokens, a.iters, a.policy, a.seconds))
        print(json.dumps(results[-1]))
    if a.json:
        from load import provenance

        provenance.write(a.json, {**provenance.header("load.bench_router", argv), "results": results}, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
