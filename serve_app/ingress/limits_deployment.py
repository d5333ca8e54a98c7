"""The TenantLimits deployment: the one owner of every tenant's limit state (serve_app/limits.py).

One replica on purpose: every ingress replica asks it, so a tenant's limits hold however many ingress replicas
serve it. Thin; the logic is `LimitState`.
"""

from __future__ import annotations

import time
from typing import Any

from ray import serve

from serve_app.limits import LimitState
from serve_app.serve_tuning import with_replica_env


# Its methods are async and cheap: on the replica's own loop, as every replica of this app (serve_tuning).
@serve.deployment(name="TenantLimits", num_replicas=1, ray_actor_options=with_replica_env({"num_cpus": 0}))
class TenantLimits:
    def __init__(self) -> None:
        self.state = LimitState()

    async def acquire(self, tenant: str, limits: dict[str, int | None], prompt_tokens: int) -> dict[str, Any]:
        return self.state.acquire(tenant, limits, prompt_tokens, time.time()).to_dict()

    async def release(self, lease: str, output_tokens: int) -> None:
        self.state.release(lease, output_tokens, time.time())


def bind_limits(settings) -> Any | None:
    """The bound deployment when some tenant has limits, else None (nothing to run)."""
    if not settings.ingress.tenants_limited:
        return None
    return TenantLimits.bind()
