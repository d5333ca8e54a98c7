"""Per-tenant limits: concurrent requests, requests and tokens per minute. Pure logic; one state for the app.

`LimitState` is owned by ONE place (the `TenantLimits` deployment, serve_app/ingress/limits_deployment.py) that every
ingress replica asks, so a tenant's limits hold across replicas. It lives in memory: a restart of that replica
loses the current minute's counts and nothing else (the issue's bound).

Per minute rates use a sliding-window counter: `used = previous_minute * (1 - elapsed_fraction) + this_minute`
(aligned 60 s windows), which avoids the double burst a fixed window allows at its boundary without keeping a
timestamp per request. Tokens: a request's prompt counts at admission, its output when it ends; a request is
admitted while the window has room for its prompt (a prompt larger than the whole limit is admitted only into an
empty window, so it is not refused forever). Concurrency: each admitted request holds a lease until the ingress
releases it; a lease that is never released (its ingress replica died) expires after LEASE_TTL_S.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 60.0
LEASE_TTL_S = 3600.0  # longer than any one generation; bounds the damage of a lost release


class SlidingWindow:
    __slots__ = ("index", "cur", "prev")

    def __init__(self) -> None:
        self.index = 0
        self.cur = 0.0
        self.prev = 0.0

    def _roll(self, now: float) -> float:
        """Move to the window containing `now`; returns the elapsed fraction of it."""
        idx = math.floor(now / WINDOW_S)
        if idx != self.index:
            self.prev = self.cur if idx == self.index + 1 else 0.0
            self.cur = 0.0
            self.index = idx
        return now / WINDOW_S - idx

    def used(self, now: float) -> float:
        frac = self._roll(now)
        return self.prev * (1.0 - frac) + self.cur

    def add(self, n: float, now: float) -> None:
        self._roll(now)
        self.cur += n

    def wait_for(self, room: float, limit: float, now: float) -> float:
        """Seconds until `used + room <= limit` (0 if it already is)."""
        frac = self._roll(now)
        elapsed = frac * WINDOW_S
        if self.prev * (1.0 - frac) + self.cur + room <= limit:
            return 0.0
        free = limit - room - self.cur
        if free >= 0 and self.prev > 0:  # enough of the previous minute slides out within this one
            return max(0.0, (1.0 - free / self.prev) * WINDOW_S - elapsed)
        free = limit - room
        if free >= 0 and self.cur > 0:  # next minute: this one becomes the sliding-out part
            return (WINDOW_S - elapsed) + max(0.0, 1.0 - free / self.cur) * WINDOW_S
        return 2 * WINDOW_S - elapsed

    def reset_in(self, now: float) -> float:
        """Seconds until the window holds nothing (fully replenished)."""
        frac = self._roll(now)
        if self.cur > 0:
            return (2.0 - frac) * WINDOW_S
        if self.prev > 0:
            return (1.0 - frac) * WINDOW_S
        return 0.0


@dataclass
class _TenantState:
    requests: SlidingWindow = field(default_factory=SlidingWindow)
    tokens: SlidingWindow = field(default_factory=SlidingWindow)
    leases: dict[str, float] = field(default_factory=dict)  # lease id -> expiry


@dataclass
class Verdict:
    ok: bool
    lease: str | None = None
    retry_after: float | None = None
    reason: str | None = None  # which limit refused
    snapshot: dict[str, Any] = field(default_factory=dict)  # for the rate-limit headers (tenants_headers)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "lease": self.lease, "retry_after": self.retry_after, "reason": self.reason,
                "snapshot": self.snapshot}


class LimitState:
    def __init__(self) -> None:
        self._tenants: dict[str, _TenantState] = {}
        self._lease_owner: dict[str, str] = {}

    def _state(self, tenant: str) -> _TenantState:
        st = self._tenants.get(tenant)
        if st is None:
            st = self._tenants[tenant] = _TenantState()
        return st

    def _expire(self, st: _TenantState, now: float) -> None:
        for lease in [k for k, exp in st.leases.items() if exp <= now]:
            del st.leases[lease]
            self._lease_owner.pop(lease, None)

    def acquire(self, tenant: str, limits: dict[str, int | None], prompt_tokens: int, now: float) -> Verdict:
        """Admit one request of `prompt_tokens` or say which limit refuses it and for how long."""
        st = self._state(tenant)
        self._expire(st, now)
        rpm, tpm, conc = limits.get("requests_per_minute"), limits.get("tokens_per_minute"), limits.get(
            "max_concurrent_requests")
        wait, reason = 0.0, None
        if conc is not None and len(st.leases) >= conc:
            # No way to know when one ends; clients back off and retry.
            wait, reason = 1.0, f"concurrent requests ({conc})"
        if rpm is not None:
            w = st.requests.wait_for(1, rpm, now)
            if w > wait:
                wait, reason = w, f"requests per minute ({rpm})"
        if tpm is not None:
            room = prompt_tokens if st.tokens.used(now) > 0 else min(prompt_tokens, tpm)
            w = st.tokens.wait_for(room, tpm, now)
            if w > wait:
                wait, reason = w, f"tokens per minute ({tpm})"
        if reason is not None:
            return Verdict(False, retry_after=max(1.0, math.ceil(wait)), reason=reason,
                           snapshot=self.snapshot(tenant, limits, now))
        lease = uuid.uuid4().hex
        st.leases[lease] = now + LEASE_TTL_S
        self._lease_owner[lease] = tenant
        st.requests.add(1, now)
        st.tokens.add(prompt_tokens, now)
        return Verdict(True, lease=lease, snapshot=self.snapshot(tenant, limits, now))

    def release(self, lease: str | None, output_tokens: int, now: float) -> None:
        """End a request: frees its concurrency slot and counts its output tokens (idempotent per lease)."""
        tenant = self._lease_owner.pop(lease, None) if lease else None
        if tenant is None:
            return
        st = self._state(tenant)
        st.leases.pop(lease, None)
        if output_tokens:
            st.tokens.add(output_tokens, now)

    def snapshot(self, tenant: str, limits: dict[str, int | None], now: float) -> dict[str, Any]:
        """{"requests"|"tokens": {"limit", "remaining", "reset_s"}} for each per-minute limit set."""
        st = self._state(tenant)
        out: dict[str, Any] = {}
        for name, window, limit in (("requests", st.requests, limits.get("requests_per_minute")),
                                    ("tokens", st.tokens, limits.get("tokens_per_minute"))):
            if limit is not None:
                out[name] = {"limit": limit, "remaining": max(0, math.floor(limit - window.used(now))),
                             "reset_s": round(window.reset_in(now), 3)}
        return out

    def in_flight(self, tenant: str, now: float) -> int:
        st = self._state(tenant)
        self._expire(st, now)
        return len(st.leases)


def limits_dict(cfg: Any) -> dict[str, int | None]:
    """The limit fields of a TenantConfig, as plain data that crosses a Ray boundary."""
    return {"max_concurrent_requests": cfg.max_concurrent_requests,
            "requests_per_minute": cfg.requests_per_minute, "tokens_per_minute": cfg.tokens_per_minute}
