"""The ingress side of tenant limits: the client of the shared limit state and the rate-limit headers.

`LimitClient` asks the one `TenantLimits` deployment (or a local `LimitState` in unit tests) to admit a request.
`RateLimitHeadersMiddleware` (pure ASGI) gives each request a holder in `REQUEST_LIMITS`; admission fills it with
the tenant's window, and the middleware writes each vendor's headers on the response, a 429 included
(`anthropic-ratelimit-*` on the Messages API, `x-ratelimit-*` on OpenAI's). The 429 body itself comes from the
API's own error helpers (a `ServiceError("rate_limit", ...)` with `retry_after`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from datetime import datetime, timezone
from typing import Any, Awaitable

from serve_app.errors import ServiceError
from serve_app.limits import LimitState, Verdict, limits_dict

log = logging.getLogger(__name__)

# Per request: {"snapshot": {...}} once a limited tenant's request was admitted or refused.
REQUEST_LIMITS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("serve_app_limits", default=None)


class RateLimited(ServiceError):
    def __init__(self, tenant: str, reason: str, retry_after: float):
        super().__init__("rate_limit", f"rate limit of tenant {tenant!r} reached: {reason}; retry after "
                         f"{retry_after:g} s", code="rate_limit_exceeded", retry_after=retry_after)
        # The metric label: "requests_per_minute", "tokens_per_minute" or "max_concurrent_requests".
        self.limit = {"requests": "requests_per_minute", "tokens": "tokens_per_minute",
                      "concurrent": "max_concurrent_requests"}.get(reason.split()[0], "rate_limit")


class LimitClient:
    """`acquire` (awaited at admission) and `release` against the shared limit state. `release` returns the call
    still in flight (None when there is none): the service awaits it before a stream's final frame, so a client
    that sends its next request the moment it reads the end finds its slot free; elsewhere it is left to land."""

    def __init__(self, backend: Any, timeout_s: float = 2.0):
        self.backend = backend  # a DeploymentHandle of TenantLimits, or a LimitState
        self.timeout_s = timeout_s

    async def acquire(self, tenant: str, cfg: Any, prompt_tokens: int) -> Verdict:
        limits = limits_dict(cfg)
        if isinstance(self.backend, LimitState):
            verdict = self.backend.acquire(tenant, limits, prompt_tokens, time.time())
        else:
            try:
                answer = await asyncio.wait_for(self.backend.acquire.remote(tenant, limits, prompt_tokens),
                                                self.timeout_s)
            except Exception as e:  # noqa: BLE001 - like the Router: an unavailable limiter must not fail requests
                log.warning("tenant limits unavailable (%s); admitting without them", type(e).__name__)
                return Verdict(True)
            verdict = Verdict(**answer)
        holder = REQUEST_LIMITS.get()
        if holder is not None:
            holder["snapshot"] = verdict.snapshot
        if not verdict.ok:
            raise RateLimited(tenant, verdict.reason or "limit", verdict.retry_after or 1.0)
        return verdict

    def release(self, lease: str | None, output_tokens: int) -> Awaitable | None:
        if lease is None:
            return None
        try:
            if isinstance(self.backend, LimitState):
                self.backend.release(lease, output_tokens, time.time())
                return None
            return self.backend.release.remote(lease, output_tokens)
        except Exception as e:  # noqa: BLE001 - a lost release expires with its lease
            log.warning("releasing a tenant lease failed: %s", e)
            return None

    async def settled(self, pending: Awaitable | None) -> None:
        """Wait, at most `timeout_s`, for a release `release` returned to reach the limit state."""
        if pending is None:
            return
        try:
            await asyncio.wait_for(pending, self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a lost release expires with its lease; the answer goes on
            log.warning("releasing a tenant lease failed: %s", type(e).__name__)


def _duration(seconds: float) -> str:
    """OpenAI's reset format: `20ms`, `1s`, `6m0s`."""
    if seconds < 1:
        return f"{int(seconds * 1000)}ms"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s}s" if m else f"{s}s"


def rate_limit_headers(snapshot: dict, anthropic: bool, now: float | None = None) -> list[tuple[str, str]]:
    now = time.time() if now is None else now
    out: list[tuple[str, str]] = []
    for name in ("requests", "tokens"):
        w = snapshot.get(name)
        if not w:
            continue
        if anthropic:
            reset = datetime.fromtimestamp(now + w["reset_s"], timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            out += [(f"anthropic-ratelimit-{name}-limit", str(w["limit"])),
                    (f"anthropic-ratelimit-{name}-remaining", str(w["remaining"])),
                    (f"anthropic-ratelimit-{name}-reset", reset)]
        else:
            out += [(f"x-ratelimit-limit-{name}", str(w["limit"])),
                    (f"x-ratelimit-remaining-{name}", str(w["remaining"])),
                    (f"x-ratelimit-reset-{name}", _duration(w["reset_s"]))]
    return out


class RateLimitHeadersMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        holder: dict = {}
        REQUEST_LIMITS.set(holder)
        path = scope.get("path", "")

        async def send_wrapper(message):
            if message["type"] == "http.response.start" and holder.get("snapshot"):
                anthropic = path.startswith("/v1/messages") or any(
                    k == b"anthropic-version" for k, _ in scope.get("headers", ()))
                extra = [(k.encode(), v.encode()) for k, v in rate_limit_headers(holder["snapshot"], anthropic)]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_wrapper)
