"""Replay a Mooncake-format trace through the production routing code (serve_app.routing.core.RouterCore).

Each trace row is one request: arrival `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (chained
hashes of 512-token blocks; the last block may be partial). The simulated replicas are the engines: each has an
LRU prefix cache of `--cache-blocks` blocks whose stores and evictions are fed to the router as KV events (or
not, with `--no-events`: the router then predicts), and serves its requests first-come first-served, each
occupying it for `uncached_prefill / prefill_tps + output / decode_tps` seconds, so load and queueing matter.
The router is told when a request's prefill ends (`mark_prefilled`) and when it finishes (`release`).

Metrics: `hit_rate` = prompt tokens served from cache / all prompt tokens; `upper_bound_hit_rate` = the same
with one unbounded cache seeing every request; `imbalance` = max/mean over replicas of the prefill tokens they
computed (uncached); `imbalance_prompt` = the same over all prompt tokens routed; TTFT from the time model.

    python -m load.sim_router --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl \
        --replicas 8 --cache-blocks 8192 --policy kv --json
    python -m load.sim_router --trace A.jsonl --trace B.jsonl --cache-blocks 8192 --cache-blocks 2048 --compare
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

from serve_app.routing.core import RouteRequest, RouterCore
from serve_app.routing.index import EVENTS

TRACE_BLOCK = 512
COMPARED = ["round_robin", "least_loaded", "session", "prefix_affinity", "kv"]


def load_trace(path: str | Path, limit: int | None = None) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
                if limit and len(rows) >= limit:
                    break
    return rows


class LruBlockCache:
    """One engine's prefix cache: a fixed number of blocks, least recently used evicted first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def leading_hits(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def store(self, hashes: list[int]) -> list[int]:
        """Insert/touch the prompt's blocks; returns the evicted ones.

        Touched tail first, so the prompt's last blocks are evicted first: vLLM frees a request's blocks in
        reverse order for the same reason (a leading run stays reusable as long as possible).
        """
        blocks = self.blocks
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        evicted = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        return evicted


def _tokens_of_blocks(k: int, input_length: int) -> int:
    return min(k * TRACE_BLOCK, input_length)


def simulate(trace: list[dict], policy: str, replicas: int = 8, cache_blocks: int = 8192, *,
             prefill_tps: float = 10_000.0, decode_tps: float = 2_500.0, speedup: float = 1.0,
             events: bool = True, seed: int = 0, **core_kwargs) -> dict:
    clock = [0.0]
    core = RouterCore(policy=policy, block_size=TRACE_BLOCK, clock=lambda: clock[0], seed=seed,
                      **{"decode_weight": prefill_tps / decode_tps, **core_kwargs})
    ids = [f"r{i}" for i in range(replicas)]
    core.sync_replicas(ids)
    if events:
        for rid in ids:
            core.set_mode(rid, EVENTS)
    caches = {rid: LruBlockCache(cache_blocks) for rid in ids}
    free_at = dict.fromkeys(ids, 0.0)
    prefill_done = dict.fromkeys(ids, 0)
    prompt_routed = dict.fromkeys(ids, 0)
    busy = dict.fromkeys(ids, 0.0)
    upper: set[int] = set()
    hit_tokens = upper_tokens = total_tokens = 0
    ttfts: list[float] = []
    pending: list[tuple[float, int, str]] = []  # (time, kind 0=prefilled 1=done, request id)
    decision_s = 0.0

    for i, row in enumerate(trace):
        t = row["timestamp"] / 1000.0 / speedup
        while pending and pending[0][0] <= t:
            when, kind, req_id = heapq.heappop(pending)
            clock[0] = when
            (core.mark_prefilled if kind == 0 else core.release)(req_id)
        clock[0] = t
        hashes = row["hash_ids"]
        n_in, n_out = row["input_length"], row["output_length"]
        req = RouteRequest(request_id=str(i), block_hashes=hashes, num_prompt_tokens=n_in,
                           expected_output_tokens=n_out)
        t0 = time.perf_counter()
        rid = core.choose(req).replica_id
        decision_s += time.perf_counter() - t0

        cache = caches[rid]
        hit = _tokens_of_blocks(cache.leading_hits(hashes), n_in)
        evicted = cache.store(hashes)
        if events:  # the engine's KV events, applied the moment they happen
            core.blocks_stored(rid, hashes)
            if evicted:
                core.blocks_removed(rid, evicted)
        k = 0
        for h in hashes:
            if h not in upper:
                break
            k += 1
        upper_tokens += _tokens_of_blocks(k, n_in)
        upper.update(hashes)

        uncached = n_in - hit
        hit_tokens += hit
        total_tokens += n_in
        prefill_done[rid] += uncached
        prompt_routed[rid] += n_in
        start = max(t, free_at[rid])
        prefilled = start + uncached / prefill_tps
        end = prefilled + n_out / decode_tps
        free_at[rid] = end
        busy[rid] += end - start
        ttfts.append(prefilled - t)
        heapq.heappush(pending, (prefilled, 0, req.request_id))
        heapq.heappush(pending, (end, 1, req.request_id))

    def imbalance(d: dict) -> float:
        mean = sum(d.values()) / len(d)
        return max(d.values()) / mean if mean else 1.0

    ttfts.sort()
    span = max(trace[-1]["timestamp"] / 1000.0 / speedup, 1e-9)
    hr, ub = hit_tokens / total_tokens, upper_tokens / total_tokens
    return {
        "policy": policy,
        "replicas": replicas,
        "cache_blocks": cache_blocks,
        "events": events,
        "requests": len(trace),
        "hit_rate": round(hr, 4),
        "upper_bound_hit_rate": round(ub, 4),
        "fraction_of_upper_bound": round(hr / ub, 4) if ub else 0.0,
        "imbalance": round(imbalance(prefill_done), 3),
        "imbalance_prompt": round(imbalance(prompt_routed), 3),
        "ttft_mean_s": round(statistics.fmean(ttfts), 3),
        "ttft_p50_s": round(ttfts[len(ttfts) // 2], 3),
        "ttft_p99_s": round(ttfts[int(len(ttfts) * 0.99)], 3),
        "max_utilization": round(max(busy.values()) / span, 3),
        "decision_us_mean": round(decision_s / len(trace) * 1e6, 1),
    }


def _table(results: list[dict]) -> str:
    head = ("| trace | cache blocks/replica | policy | hit rate | % of upper bound | imbalance (prefill) "
            "| imbalance (prompt) | TTFT mean / p99 (s) |")
    lines = [head, "|" + "---|" * 8]
    for r in results:
        lines.append(
            f"| {r['trace']} | {r['cache_blocks']} | {r['policy']} | {r['hit_rate']:.1%} | "
            f"{r['fraction_of_upper_bound']:.1%} | {r['imbalance']:.2f} | {r['imbalance_prompt']:.2f} | "
            f"{r['ttft_mean_s']:.2f} / {r['ttft_p99_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", action="append", required=True)
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--cache-blocks", type=int, action="append")
    p.add_argument("--policy", default="kv")
    p.add_argument("--compare", action="store_true", help="run every policy; print a markdown table")
    p.add_argument("--prefill-tps", type=float, default=10_000.0)
    p.add_argument("--decode-tps", type=float, default=2_500.0)
    p.add_argument("--speedup", type=float, default=1.0, help="compress arrival times by this factor")
    p.add_argument("--overlap-weight", type=float, action="append",
                   help="kv policy's overlap weight (repeat to compare several; default: the router's)")
    p.add_argument("--no-events", action="store_true", help="the router predicts instead of getting KV events")
    p.add_argument("--limit", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    caches = a.cache_blocks or [8192]
    runs: list[tuple[str, dict]] = []
    for pol in COMPARED if a.compare else [a.policy]:
        if pol == "kv" and a.overlap_weight:
            runs += [("kv", {"overlap_weight": w}) for w in a.overlap_weight]
        else:
            runs.append((pol, {}))
    results = []
    for path in a.trace:
        trace = load_trace(path, a.limit)
        for c in caches:
            for pol, kw in runs:
                r = simulate(trace, pol, a.replicas, c, prefill_tps=a.prefill_tps, decode_tps=a.decode_tps,
                             speedup=a.speedup, events=not a.no_events, seed=a.seed, **kw)
                if kw:
                    r["policy"] = f"{pol} (overlap_weight={kw['overlap_weight']:g})"
                r["trace"] = Path(path).stem.replace("mooncake_fast25_", "").replace("_trace", "")
                results.append(r)
                if not a.json:
                    print(json.dumps(r), file=sys.stderr)
    if a.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
    else:
        print(_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
