"""Fair shares of one engine's queue among the tenants of a tier: start-time fair queuing on vLLM's priority.

vLLM's priority scheduling admits waiting requests by (priority, arrival). A tenant's tier and a request's hint
make the priority (serve_app/tenants.py), so within one tier the order was arrival alone: one teammate's burst (a CI
run opening fifty agent sessions) queued ahead of every later request of every other tenant of that tier, an
interactive turn waiting for the whole burst to be admitted first.

Start-time fair queuing (Goyal, Vin and Cheng, 1996) orders them by share instead. Each request of tenant T gets a
start tag `S = max(V, F[T])` and moves T's finish tag to `F[T] = S + 1`; V, the engine's virtual time, is the
largest tag of a request that has begun (its first output). vLLM then sees `priority * SPAN + S`: the tier and the
hint first, as before, and within them the tag, lowest first. So a tenant with fifty requests waiting holds tags
V..V+49 while another tenant's next request gets V and is admitted at the next free slot; two tenants that both keep
requests waiting alternate; a tenant that was idle starts at V, with no credit saved up and no debt carried over
(the tags before V belong to requests already running). One tenant alone gets increasing tags: first come, first
served, as before. Each request costs one: shares are of admissions, not of tokens.

Why in the engine and not at the ingress: tags compare only within one queue, and the engine replica is the one
place that sees every request of its queue, whichever ingress replica sent it. A request without a tenant (the
next turn's speculative warm-up; every request where `ingress.fair_share` is off) is charged to no one and gets V.
"""

from __future__ import annotations

# vLLM priorities cross to the engine core as msgpack int64: |priority| * SPAN + S stays far below 2**63 for the
# priorities the service sets (|priority| <= ~101,000, serve_app/tenants.py) and a trillion requests of one engine.
SPAN = 1 << 40
PRIORITY_BOUND = (1 << 62) // SPAN
# Tenants whose finish tag V has passed carry no state (they would start at V anyway); past this many entries
# they are dropped, so the table stays about the size of the tenants with requests waiting. The next prune waits
# until the table has doubled again, so many tenants all waiting cost no walk per request.
_PRUNE_AT = 256


class FairShare:
    """The start tags of one engine's requests. Pure and single-threaded (the engine's event loop)."""

    __slots__ = ("vtime", "_finish", "_prune_at")

    def __init__(self) -> None:
        self.vtime = 0
        self._finish: dict[str, int] = {}
        self._prune_at = _PRUNE_AT

    def tag(self, tenant: str | None, priority: int) -> tuple[int, int]:
        """(vLLM's priority, the start tag) for a request of `tenant` at `priority` (lower first)."""
        if not -PRIORITY_BOUND < priority < PRIORITY_BOUND:
            raise ValueError(f"priority {priority} out of range")
        start = self.vtime
        if tenant is not None:
            start = max(start, self._finish.get(tenant, 0))
            self._finish[tenant] = start + 1
            if len(self._finish) > self._prune_at:
                self._finish = {t: f for t, f in self._finish.items() if f > self.vtime}
                self._prune_at = max(_PRUNE_AT, 2 * len(self._finish))
        return priority * SPAN + start, start

    def started(self, start: int) -> None:
        """A request tagged `start` produced its first output: it was admitted, so V is at least its tag."""
        if start > self.vtime:
            self.vtime = start
