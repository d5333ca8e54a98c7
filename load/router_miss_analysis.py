"""Why the `ttft` policy misses the hit-rate bar where it does: where its cache hits go, in the trace simulation.

    python -m load.router_miss_analysis      # -> load/results/router_miss_analysis.json

For the bar's failing row (conversation, 8192 blocks per replica) it splits each policy's shortfall from the
unbounded-cache bound into
- capacity: blocks of the prompt's bound prefix that no replica held at decision time (evicted everywhere), and
- routing: blocks the best-placed replica held but the chosen one did not (the policy sent it elsewhere),
and for `ttft`'s moves (decisions away from the largest cached prefix) the predicted wait at the replica holding
it and at the one chosen. It also measures two things a missing cost term would show up in:
- eviction regret: of the blocks each replica evicted, the share a later request routed to that replica needed
  again (what recomputing elsewhere, which stores and so evicts there, costs later), on every cache-bound row;
- prediction calibration: ttft's predicted TTFT at the chosen replica against the simulated one, binned, and the
  jitter of the prediction errors per replica (what the ttft policy's margin for leaving cached blocks is made of).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from load import provenance
from load.sim_router import RESULTS, SHIPPED, UNSEEN, simulate, trace_rows
from serve_app.routing.core import RouterCore
from serve_app.routing.policies import prefill_left
from serve_app.routing.ttft import predict_ttft

BLOCK = 512
SOURCES = {name: (source, speedup) for name, source, speedup in SHIPPED + UNSEEN}


class ObservedCore(RouterCore):
    """RouterCore that records, per decision, what the index held and what the policy predicted."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.bound: set[int] = set()
        self.split = {"tokens": 0, "capacity": 0, "routing": 0, "moves": 0}
        self.moves: list[tuple[float, float]] = []  # (predicted wait at the best-cached replica, at the chosen)
        self.evicted: set[tuple[str, int]] = set()
        self.regret = {"evicted_blocks": 0, "needed_again": 0}
        self.predicted: dict[str, tuple[float, float]] = {}
        self.pairs: list[tuple[float, float]] = []

    def choose(self, req, candidates=None):
        cands = list(self.loads)
        _, overlaps, uncached = prefill_left(self, req, cands)
        waits = {r: predict_ttft(self, r, uncached[r], self.step_tokens) for r in cands}
        d = super().choose(req, candidates)
        rid = d.replica_id
        k = 0
        for h in req.block_hashes:
            if h not in self.bound:
                break
            k += 1
        self.bound.update(req.block_hashes)
        best = max(overlaps.values())
        self.split["tokens"] += req.num_prompt_tokens
        self.split["capacity"] += max(0, k - best) * BLOCK
        self.split["routing"] += (best - overlaps[rid]) * BLOCK
        if overlaps[rid] < best:
            self.split["moves"] += 1
            home = max(cands, key=lambda r: (overlaps[r], -waits[r]))
            self.moves.append((waits[home], waits[rid]))
        for h in req.block_hashes:
            if (rid, h) in self.evicted:
                self.evicted.discard((rid, h))
                self.regret["needed_again"] += 1
        self.predicted[req.request_id] = (waits[rid], self.now())
        return d

    def blocks_removed(self, replica_id, hashes):
        hashes = list(hashes)
        self.regret["evicted_blocks"] += len(hashes)
        self.evicted.update((replica_id, h) for h in hashes)
        super().blocks_removed(replica_id, hashes)

    def mark_prefilled(self, request_id, cached_tokens=None):
        p = self.predicted.pop(request_id, None)
        if p is not None:
            self.pairs.append((p[0], self.now() - p[1]))
        super().mark_prefilled(request_id, cached_tokens)


def _observe(name: str, policy: str, blocks: int) -> tuple[dict, ObservedCore]:
    source, speedup = SOURCES[name]
    cores = []

    def make(*a, **kw):
        core = ObservedCore(*a, **kw)
        cores.append(core)
        return core

    r = simulate(trace_rows(source), policy, 8, blocks, speedup=speedup, core_cls=make)
    return r, cores[0]


def _median(xs):
    return round(statistics.median(xs), 3) if xs else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # No options: this only lets `--help` answer instead of running and rewriting the result file.
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    started = time.perf_counter()
    split = []
    for policy in ("ttft", "kv", "prefix_affinity"):
        r, core = _observe("conversation", policy, 8192)
        s = core.split
        split.append({"trace": "conversation", "cache_blocks": 8192, "policy": policy,
                      "fraction_of_upper_bound": r["fraction_of_upper_bound"], "ttft_mean_s": r["ttft_mean_s"],
                      "ttft_p99_s": r["ttft_p99_s"],
                      "capacity_loss_of_prompt_tokens": round(s["capacity"] / s["tokens"], 4),
                      "routing_loss_of_prompt_tokens": round(s["routing"] / s["tokens"], 4),
                      "moves": s["moves"],
                      "moves_predicted_wait_s_median": {"best_cached": _median([m[0] for m in core.moves]),
                                                        "chosen": _median([m[1] for m in core.moves])},
                      # what the ttft policy's margin is made of, as the run ends: per replica, the standard
                      # deviation of its prediction errors from one request to the next
                      "prediction_jitter_s": [round(core.rates[rid].prediction_variance() ** 0.5, 3)
                                              for rid in sorted(core.rates)]})
        if policy == "ttft":
            calib = []
            bins = [0, 0.25, 0.5, 1, 2, 4, 8, float("inf")]
            for lo, hi in zip(bins, bins[1:]):
                sel = [(p, a) for p, a in core.pairs if lo <= p < hi]
                if sel:
                    calib.append({"predicted_s": [lo, hi if hi != float("inf") else None], "requests": len(sel),
                                  "predicted_mean_s": round(statistics.fmean(p for p, _ in sel), 3),
                                  "simulated_mean_s": round(statistics.fmean(a for _, a in sel), 3)})
    regret = []
    for name, blocks in (("conversation", 8192), ("conversation", 2048), ("synthetic", 2048),
                         ("agentic_unseen", 2048)):
        _, core = _observe(name, "ttft", blocks)
        g = core.regret
        regret.append({"trace": name, "speedup": SOURCES[name][1], "cache_blocks": blocks, **g,
                       "share": round(g["needed_again"] / g["evicted_blocks"], 4) if g["evicted_blocks"] else 0.0})
    doc = {**provenance.header("load.router_miss_analysis", argv),
           "wall_s": round(time.perf_counter() - started, 1), "hit_rate_split": split,
           "ttft_calibration_conversation_8192": calib, "eviction_regret_ttft": regret}
    out = RESULTS / "router_miss_analysis.json"
    provenance.write(out, doc, indent=1)
    print(json.dumps({k: doc[k] for k in ("hit_rate_split", "ttft_calibration_conversation_8192",
                                          "eviction_regret_ttft")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
