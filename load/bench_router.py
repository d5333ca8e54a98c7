"""Router decision latency and hashing speed, with 100K+ blocks indexed.

    python -m load.bench_router [--replicas 8] [--blocks-per-replica 12500] [--block-size 16] [--prompt-tokens 32000]

Fills each replica's index (events mode) with distinct prompts, then times `RouterCore.choose` + `release` for
prompts that match a prefix on one replica (the common agent case) and for unseen prompts, and times
`block_hashes` over the prompt. Prints JSON with p50/p99 in microseconds.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from serve_app.routing.core import RouteRequest, RouterCore
from serve_app.routing.hashing import block_hashes
from serve_app.routing.index import EVENTS


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def bench(replicas: int, blocks_per_replica: int, block_size: int, prompt_tokens: int, iters: int) -> dict:
    rng = random.Random(0)
    core = RouterCore("kv", block_size, seed=0)
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

    toks = [rng.randrange(150_000) for _ in range(prompt_tokens)]
    t_hash = []
    for _ in range(max(5, iters // 20)):
        t0 = time.perf_counter()
        block_hashes(toks, block_size)
        t_hash.append(time.perf_counter() - t0)

    us = lambda xs, q: round(_pct(xs, q) * 1e6, 1)  # noqa: E731
    return {
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
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--blocks-per-replica", type=int, default=12_500)
    p.add_argument("--block-size", type=int, action="append")
    p.add_argument("--prompt-tokens", type=int, default=32_000)
    p.add_argument("--iters", type=int, default=2000)
    a = p.parse_args(argv)
    for bs in a.block_size or [16, 128]:
        print(json.dumps(bench(a.replicas, a.blocks_per_replica, bs, a.prompt_tokens, a.iters)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
