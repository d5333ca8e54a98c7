"""What crosses between the ingress and the Router: plain data, light to import (the ingress and the policies
name these without loading the routing core)."""

from __future__ import annotations

from dataclasses import dataclass, field

# The front door's Router (routing/front_door_deployment.py) names its reservation for a request here; HAProxy sets
# it, from the Router's answer, on the request it forwards (clients' own `x-serve-router-*` headers are stripped).
ROUTE_ID_HEADER = "x-serve-router-route-id"


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

    @property
    def outcome(self) -> str:
        """`router_decisions_total`'s outcome label for a decision made, the same wherever it is recorded (the
        ingress for the Engine placement, the front door's Router for the engines in the ingress)."""
        return "cache_hit" if self.cached_blocks else "cache_miss"
