"""RouterCore: the routing state and decision, free of Ray so it can be unit-tested and simulated.

The Router deployment wraps one RouterCore; the Serve request router (in each ingress process) asks it for a
replica per request. Every decision reserves load on the chosen replica until `release` is called, so a burst
of requests does not all land on the replica that looked best at the start of the burst.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(slots=True)
class RouteRequest:
    request_id: str
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the prompt's full blocks
    num_prompt_tokens: int = 0
    expected_output_tokens: int = 256  # agent_hints.osl when given
    session_key: str | None = None


@dataclass(slots=True)
class Decision:
    replica_id: str
    policy: str
    cached_blocks: int = 0  # blocks of the prompt the chosen replica is believed to hold


@dataclass(slots=True)
class ReplicaLoad:
    active_requests: int = 0
    active_prefill_tokens: int = 0
    active_decode_tokens: int = 0


class RouterCore:
    def __init__(self, policy: str = "least_loaded", block_size: int = 16):
        self.policy = policy
        self.block_size = block_size
        self.loads: dict[str, ReplicaLoad] = {}
        self._inflight: dict[str, tuple[str, int, int]] = {}  # request_id -> (replica, prefill, decode)
        self._rr = itertools.count()

    def sync_replicas(self, replica_ids: list[str]) -> None:
        """Make the known replicas exactly `replica_ids` (a removed or dead replica disappears)."""
        live = set(replica_ids)
        for rid in list(self.loads):
            if rid not in live:
                del self.loads[rid]
        for rid in replica_ids:
            self.loads.setdefault(rid, ReplicaLoad())

    def choose(self, req: RouteRequest, candidates: list[str]) -> Decision:
        if not candidates:
            raise ValueError("no candidate replicas")
        for rid in candidates:
            self.loads.setdefault(rid, ReplicaLoad())
        if self.policy == "round_robin":
            rid = candidates[next(self._rr) % len(candidates)]
        else:
            rid = min(candidates, key=lambda r: (self.loads[r].active_requests, self.loads[r].active_prefill_tokens))
        self._reserve(req, rid, req.num_prompt_tokens)
        return Decision(replica_id=rid, policy=self.policy)

    def _reserve(self, req: RouteRequest, rid: str, prefill_tokens: int) -> None:
        load = self.loads[rid]
        load.active_requests += 1
        load.active_prefill_tokens += prefill_tokens
        load.active_decode_tokens += req.expected_output_tokens
        self._inflight[req.request_id] = (rid, prefill_tokens, req.expected_output_tokens)

    def release(self, request_id: str) -> None:
        entry = self._inflight.pop(request_id, None)
        if entry is None:
            return
        rid, prefill, decode = entry
        load = self.loads.get(rid)
        if load is not None:
            load.active_requests -= 1
            load.active_prefill_tokens -= prefill
            load.active_decode_tokens -= decode

    def metrics(self) -> dict:
        return {
            "policy": self.policy,
            "replicas": {rid: vars(l) if hasattr(l, "__dict__") else {
                "active_requests": l.active_requests,
                "active_prefill_tokens": l.active_prefill_tokens,
                "active_decode_tokens": l.active_decode_tokens,
            } for rid, l in self.loads.items()},
            "inflight": len(self._inflight),
        }
