"""Fair shares of one engine's queue among the tenants of a tier: start-time fair queuing on vLLM's priority.

vLLM's priority scheduling admits waiting requests by (priority, arrival). A tenant's tier and a request's hint
make the priority (serve_app/tenants.py), so within one tier the order was arrival alone: one teammate's burst (a CI
run opening fifty agent sessions) queued ahead of every later request of every other tenant of that tier, an
interactive turn waiting for the whole burst to be admitted first.

Start-time fair queuing (Goyal, Vin and Cheng, 1996) orders them by share instead. Each request of tenant T gets a
start tag `S = max(V, F[T])` and moves T's finish tag to `F[T] = S + COST / share[T]`; V, the engine's virtual time,
is the largest tag of a request that has begun (its first output). vLLM then sees `priority * SPAN + S`: the tier
and the hint first, as before, and within them the tag, lowest first. So a tenant with fifty requests waiting holds tags
V..V+49 while another tenant's next request gets V and is admitted at the next free slot; two tenants that both keep
requests waiting alternate; a tenant that was idle starts at V, with no credit saved up and no debt carried over
(the tags before V belong to requests already running). One tenant alone gets increasing tags: first come, first
served, as before. A tenant's `share` (its weight, serve_app/settings.TenantConfig) divides the cost of its
requests: while both keep requests waiting, a tenant of share 2 is admitted twice as often as one of share 1. Each
request costs the same: shares are of admissions, not of tokens.

Why in the engine and not at the ingress: tags compare only within one queue, and the engine replica is the one
place that sees every request of its queue, whichever ingress replica sent it. A request without a tenant (the
next turn's speculative warm-up; every request where `ingress.fair_share` is off) is charged to no one and gets V.
"""

from __future__ import annotations

# vLLM priorities cross to the engine core as msgpack int64: |priority| * SPAN + S stays below 2**62 for the
# priorities the service sets (|priority| <= ~101,000 < PRIORITY_BOUND, serve_app/tenants.py).
SPAN = 1 << 45
PRIORITY_BOUND = (1 << 62) // SPAN
# A request of share 1 moves its tenant's tag this far; one of share s, COST / s rounded (within 0.4% for the shares
# TenantConfig allows, exact for powers of two). Tags stay under SPAN for 2**31 admissions of share 1 (eight months
# at a hundred a second); past that the table starts again at 0 (`_restart`).
COST = 1 << 14
MAX_SHARE = 100
# Tenants whose finish tag V has passed carry no state (they would start at V anyway); past this many entries
# they are dropped, so the table stays about the size of the tenants with requests waiting. The next prune waits
# until the table has doubled again, so many tenants all waiting cost no walk per request.
_PRUNE_AT = 256


class FairShare:
    """The start tags of one engine's requests. Pure and single-threaded (the engine's event loop)."""

    __slots__ = ("vtime", "_finish", "_prune_at", "_top")

    def __init__(self) -> None:
        self.vtime = 0
        self._finish: dict[str, int] = {}
        self._prune_at = _PRUNE_AT
        self._top = 0  # the largest start tag handed out since the table (re)started

    def tag(self, tenant: str | None, priority: int, share: int = 1) -> tuple[int, int]:
        """(vLLM's priority, the start tag) for a request of `tenant`, whose weight is `share`, at `priority`
        (lower first)."""
        if not -PRIORITY_BOUND < priority < PRIORITY_BOUND:
            raise ValueError(f"priority {priority} out of range")
        if not 1 <= share <= MAX_SHARE:
            raise ValueError(f"share {share} out of range")
        start = self.vtime
        if tenant is not None:
            start = max(start, self._finish.get(tenant, 0))
            cost = (COST + share // 2) // share
            if start + cost >= SPAN:  # after ~2**31 admissions: requests still waiting keep their old, higher tags
                self._restart()
                start = 0
            self._finish[tenant] = start + cost
            if len(self._finish) > self._prune_at:
                self._finish = {t: f for t, f in self._finish.items() if f > self.vtime}
                self._prune_at = max(_PRUNE_AT, 2 * len(self._finish))
        self._top = max(self._top, start)
        return priority * SPAN + start, start

    def _restart(self) -> None:
        self.vtime = self._top = 0
        self._finish = {}
        self._prune_at = _PRUNE_AT

    def started(self, start: int) -> None:
        """A request tagged `start` produced its first output: it was admitted, so V is at least its tag. (A tag
        above any handed out since the table restarted is from before it, and moves nothing.)"""
        if self.vtime < start <= self._top:
            self.vtime = start
