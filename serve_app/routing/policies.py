"""Routing policies: given the request, the candidates, their loads and the KV index, pick one replica.

A policy reads the router's state through a `RouterState` (the RouterCore) and never mutates it; the core
does the bookkeeping (reservation, predicted blocks, session memory) after the pick, the same for every policy.

Each policy declares its own options as a `Config` dataclass (the kv weights live on `KvConfig`) and `forget`s a
removed replica; `registry.py` lists them, by name, once.

- `ttft` (default, in ttft.py): lowest predicted time to first token in seconds, from measured replica rates.
- `kv`: Dynamo's cost, in prefill-token units: overlap_weight * (prompt tokens left to prefill after
  the replica's cached overlap) + prefill tokens already reserved there + decode_weight * expected output tokens
  outstanding there. Argmin; within one block of the minimum the session's last replica wins, then the replica
  with fewer active requests and less recent prefill work. A prompt that no replica holds 10% of is placed as a
  new cache footprint (see `_place_new`). overlap_weight 0 is pure load balancing, 1 is Dynamo's default (TTFT
  first); higher keeps prefixes where they are cached under more load. The router defaults to 32, the hit-rate
  optimum in the trace simulation (load/sim_router.py); the price is that a burst sharing a cached prefix only
  spreads once the queue there exceeds 32x the cached tokens.
- `least_loaded`: the same load term without the overlap credit.
- `round_robin`.
- `session`: sticky per session key (first placement least-loaded); no key -> least loaded.
- `prefix_affinity`: Ray Serve's PrefixCacheAffinityRouter algorithm as documented (for the simulation only):
  a prefix tree of what was sent where, no eviction by default, match-rate threshold 0.1, queue-length
  imbalance threshold with a power-of-two fallback. Blocks stand in for its characters.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from serve_app.routing.types import RouteRequest

if TYPE_CHECKING:
    from serve_app.routing.index import KvIndex

RECENT_WORK_HALF_LIFE_S = 3600.0  # memory of where prefill work (new cache footprint) went
NEW_PROMPT_OVERLAP = 0.1  # best cached overlap below this fraction of the prompt: place as a new footprint
PLACEMENT_BAND = 4.0  # new footprints may go to a replica up to this many prompts busier than the idlest


@dataclass(slots=True)
class ReplicaLoad:
    active_requests: int = 0
    active_prefill_tokens: int = 0  # reserved, not yet reported prefilled
    active_decode_tokens: int = 0  # expected output tokens of outstanding requests
    recent_work: float = 0.0  # uncached prefill tokens sent here, decayed with RECENT_WORK_HALF_LIFE_S
    recent_t: float = 0.0
    routed: int = 0  # requests routed here since it joined (metrics: a joining replica gets traffic)

    def recent(self, now: float) -> float:
        if self.recent_work == 0.0:
            return 0.0
        return self.recent_work * math.exp2(-(now - self.recent_t) / RECENT_WORK_HALF_LIFE_S)

    def add_recent(self, tokens: float, now: float) -> None:
        self.recent_work = self.recent(now) + tokens
        self.recent_t = now

    def take_back_recent(self, tokens: float, at: float, now: float) -> float:
        """`tokens` added at `at` were never prefilled here (the request went elsewhere or never ran); returns
        what they had decayed to."""
        decayed = tokens * math.exp2(-(now - at) / RECENT_WORK_HALF_LIFE_S)
        left = self.recent(now) - decayed
        self.recent_work = left if left > 1e-6 else 0.0
        self.recent_t = now
        return decayed


class RouterState(Protocol):
    block_size: int
    loads: dict[str, ReplicaLoad]
    index: KvIndex
    rng: random.Random

    def now(self) -> float: ...
    def session_replica(self, key: str | None) -> str | None: ...


def prompt_tokens(req: RouteRequest, block_size: int) -> int:
    return req.num_prompt_tokens or len(req.block_hashes) * block_size


def prefill_left(state: RouterState, req: RouteRequest, candidates: Sequence[str]) -> tuple[int, dict, dict]:
    """(prompt tokens, cached blocks per candidate, prompt tokens each candidate would still have to prefill)."""
    bs = state.block_size
    n = prompt_tokens(req, bs)
    overlaps = state.index.overlaps(req.block_hashes, candidates, state.now())
    return n, overlaps, {rid: n - min(overlaps[rid] * bs, n) for rid in candidates}


def load_cost(state: RouterState, rid: str, decode_weight: float) -> float:
    load = state.loads[rid]
    return load.active_prefill_tokens + decode_weight * load.active_decode_tokens


# Output tokens cost more replica time than prompt tokens (decode is memory-bound); 4 prefill tokens per output
# token is a middle value for batched decode on GPUs.
DECODE_WEIGHT = 4.0


@dataclass(frozen=True, slots=True)
class LoadConfig:
    decode_weight: float = DECODE_WEIGHT


@dataclass(frozen=True, slots=True)
class KvConfig:
    # Cached tokens are worth more than the queue they save now: a prefix sent elsewhere is recomputed AND evicts
    # other prefixes there. 32 maximises hit rate in the trace simulation (routing/README.md).
    overlap_weight: float = 32.0
    decode_weight: float = DECODE_WEIGHT


def _tie_break(state: RouterState, req: RouteRequest, tied: list[str]) -> str:
    if len(tied) == 1:
        return tied[0]
    sticky = state.session_replica(req.session_key)
    if sticky in tied:
        return sticky
    now = state.now()
    loads = state.loads
    best = min((loads[r].active_requests, loads[r].recent(now)) for r in tied)
    tied = [r for r in tied if (loads[r].active_requests, loads[r].recent(now)) == best]
    return tied[0] if len(tied) == 1 else state.rng.choice(tied)


class Policy:
    name: ClassVar[str] = "base"
    Config: ClassVar[type | None] = None  # the dataclass of this policy's own options, if it has any

    def __init__(self, config: Any = None):
        self.config = config if config is not None else (self.Config() if self.Config is not None else None)

    def choose(self, state: RouterState, req: RouteRequest, candidates: Sequence[str]) -> tuple[str, int]:
        """Return (replica, cached blocks believed to be there)."""
        raise NotImplementedError

    def on_routed(self, state: RouterState, req: RouteRequest, rid: str) -> None:
        """Hook for policies that keep their own state (the prefix-tree emulation)."""

    def on_moved(self, state: RouterState, block_hashes: list[int], rid: str) -> None:
        """The request whose prompt is `block_hashes` ran on `rid`, not where it was routed (RouterCore.redirect)."""

    def forget(self, rid: str) -> None:
        """`rid` is gone: drop whatever the policy keeps about it."""


class KvPolicy(Policy):
    name = "kv"
    Config = KvConfig

    def choose(self, state, req, candidates):
        bs = state.block_size
        w = self.config
        n, overlaps, uncached = prefill_left(state, req, candidates)
        costs = {rid: w.overlap_weight * uncached[rid] + load_cost(state, rid, w.decode_weight) for rid in candidates}
        if max(overlaps.values()) * bs < NEW_PROMPT_OVERLAP * n:
            rid = self._place_new(state, req, candidates, n)
            return rid, overlaps[rid]
        low = min(costs.values())
        tolerance = w.overlap_weight * bs  # one block: no real difference in work
        tied = [r for r in candidates if costs[r] <= low + tolerance]
        # Within the tie band the exact minimum still wins unless the session's replica is in the band.
        sticky = state.session_replica(req.session_key)
        if sticky not in tied:
            tied = [r for r in tied if costs[r] == low]
        rid = _tie_break(state, req, tied)
        return rid, overlaps[rid]


    def _place_new(self, state, req, candidates, n):
        """A prompt no replica holds much of (a new conversation or document) starts a new cache footprint.

        Where it lands decides where its future turns hit, so spread footprints evenly: among replicas whose
        load is within PLACEMENT_BAND prompts of the least loaded, take the one that has computed the least
        prefill lately (what it had to store, hence evict). Placing by load alone piles long-lived sessions
        onto whichever replica was momentarily idle.
        """
        sticky = state.session_replica(req.session_key)
        loads = {r: load_cost(state, r, self.config.decode_weight) for r in candidates}
        lo = min(loads.values())
        band = [r for r in candidates if loads[r] <= lo + PLACEMENT_BAND * n]
        if sticky in band:
            return sticky
        now = state.now()
        return min(band, key=lambda r: (state.loads[r].recent(now), loads[r]))


class LeastLoadedPolicy(Policy):
    name = "least_loaded"
    Config = LoadConfig

    def choose(self, state, req, candidates):
        costs = {rid: load_cost(state, rid, self.config.decode_weight) for rid in candidates}
        low = min(costs.values())
        rid = _tie_break(state, req, [r for r in candidates if costs[r] == low])
        return rid, 0


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, config: Any = None):
        super().__init__(config)
        self._next = 0

    def choose(self, state, req, candidates):
        rid = candidates[self._next % len(candidates)]
        self._next += 1
        return rid, 0


class SessionPolicy(Policy):
    name = "session"
    Config = LoadConfig

    def __init__(self, config: LoadConfig | None = None):
        super().__init__(config)
        self._fallback = LeastLoadedPolicy(self.config)

    def choose(self, state, req, candidates):
        sticky = state.session_replica(req.session_key)
        if sticky is not None and sticky in candidates:
            return sticky, 0
        return self._fallback.choose(state, req, candidates)


@dataclass(frozen=True, slots=True)
class PrefixAffinityConfig:
    match_rate_threshold: float = 0.1
    imbalanced_threshold: float = 10
    max_units: int | None = None


class PrefixAffinityPolicy(Policy):
    """Ray Serve PrefixCacheAffinityRouter, per its documentation and source (ray 2.60), over blocks.

    1. If max-min queue length over the candidates exceeds `imbalanced_threshold`: power of two choices.
    2. Else match the prompt against the tree of prompts already routed. match_rate = matched / prompt length.
       Below `match_rate_threshold`: the replicas with the least text in the tree. Otherwise the replicas
       owning the deepest match. Serve then takes the shortest queue in that group.
    3. After routing, the prompt is inserted under the chosen replica (no eviction unless `max_units`).
    """

    name = "prefix_affinity"
    Config = PrefixAffinityConfig

    def __init__(self, config: PrefixAffinityConfig | None = None):
        super().__init__(config)
        self.match_rate_threshold = self.config.match_rate_threshold
        self.imbalanced_threshold = self.config.imbalanced_threshold
        self.max_units = self.config.max_units
        self.tree: dict[str, dict[int, None]] = {}  # tenant -> ordered set of block ids (LRU order)
        self.size: dict[str, int] = {}  # tenant -> units (block-chars) in the tree

    def choose(self, state, req, candidates):
        loads = state.loads
        rng = state.rng
        queues = [loads[r].active_requests for r in candidates]
        if max(queues) - min(queues) > self.imbalanced_threshold:
            pair = rng.sample(list(candidates), 2) if len(candidates) > 1 else list(candidates)
            return min(pair, key=lambda r: loads[r].active_requests), 0
        bs = state.block_size
        n = prompt_tokens(req, bs)
        matched = {}
        for rid in candidates:
            owned = self.tree.get(rid, {})
            k = 0
            for h in req.block_hashes:
                if h not in owned:
                    break
                k += 1
            matched[rid] = k
        deepest = max(matched.values())
        if n == 0 or min(deepest * bs, n) / n < self.match_rate_threshold:
            smallest = min(self.size.get(r, 0) for r in candidates)
            group = [r for r in candidates if self.size.get(r, 0) == smallest]
        else:
            group = [r for r in candidates if matched[r] == deepest]
        shortest = min(loads[r].active_requests for r in group)
        group = [r for r in group if loads[r].active_requests == shortest]
        rid = group[0] if len(group) == 1 else rng.choice(group)
        return rid, matched[rid]

    def on_routed(self, state, req, rid):
        self.on_moved(state, req.block_hashes, rid)

    def on_moved(self, state, block_hashes, rid):
        # Ray's router inserts a prompt where it sent it; where the request really ran is where its text is.
        owned = self.tree.setdefault(rid, {})
        added = 0
        for h in block_hashes:
            if h in owned:
                del owned[h]
            else:
                added += state.block_size
            owned[h] = None
        self.size[rid] = self.size.get(rid, 0) + added
        if self.max_units is not None:
            while self.size[rid] > self.max_units and owned:
                del owned[next(iter(owned))]
                self.size[rid] -= state.block_size

    def forget(self, rid: str) -> None:
        self.tree.pop(rid, None)
        self.size.pop(rid, None)
