"""Who is calling: API key -> tenant, the tenant's prefix-cache salt and allowed models.

`ingress.api_keys` holds plain strings (all the unnamed `default` tenant, as before tenants existed) or
`{key, tenant}` entries naming a tenant of `ingress.tenants`; an entry without `key` takes requests that present
no key or an unknown one (open access beside keyed tenants). Keys are compared in constant time against every
entry (no early exit) and never logged or echoed.

The tenant found by the route's key check rides a context variable to `GenerationService.prepare`, which runs in
the same request task, so the routes need no tenant plumbing. Limits are enforced elsewhere (serve_app/limits.py,
one state for all ingress replicas); this module is pure and imports only the settings.
"""

from __future__ import annotations

import contextvars
import hmac
from typing import Mapping

from serve_app.errors import ServiceError
from serve_app.settings import ApiKey, IngressConfig, ModelConfig, TenantConfig

DEFAULT = "default"
_UNLIMITED = TenantConfig()

# The tenant of the request being handled (set by the key check); None outside a request = the default tenant.
CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("serve_app_tenant", default=None)


def presented_key(headers: Mapping[str, str]) -> str | None:
    key = headers.get("x-api-key")
    if key:
        return key.strip()
    auth = headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return None


def resolve(headers: Mapping[str, str], api_keys: list[str | ApiKey]) -> str:
    """The tenant of the request's key; 401 when keys are configured and none matches (and no open entry)."""
    if not api_keys:
        return DEFAULT
    key = presented_key(headers)
    fallback: str | None = None
    found: str | None = None
    probe = (key or "").encode()
    for entry in api_keys:  # every entry is compared: the time taken does not reveal which key matched
        candidate, tenant = (entry, DEFAULT) if isinstance(entry, str) else (entry.key, entry.tenant)
        if candidate is None:
            fallback = tenant
            continue
        if hmac.compare_digest(probe, candidate.encode()) and key is not None and found is None:
            found = tenant
    if found is not None:
        return found
    if fallback is not None:
        return fallback
    if key is None:
        raise ServiceError("authentication", "missing API key: send x-api-key or Authorization: Bearer")
    raise ServiceError("authentication", "invalid API key")


def key_required(api_keys: list[str | ApiKey]) -> bool:
    """Whether a request without a key is refused (401): keys are configured and none is an open entry."""
    return bool(api_keys) and all(isinstance(e, str) or e.key is not None for e in api_keys)


def config_of(ingress: IngressConfig, tenant: str | None) -> TenantConfig:
    return ingress.tenants.get(tenant or DEFAULT, _UNLIMITED)


# vLLM runs lower priority values first; here, as in `agent_hints.priority` and a tenant's `priority`, higher is more
# important. A tenant's tier spans TIER values, and a request's hint moves it only within them: hints are the
# client's word, tiers the operator's.
TIER = 1000
HINT_BOUND = TIER // 2 - 1
# Speculative work (the next turn's warm-up, `agent_hints.speculative_prefill`) yields to every real request.
SPECULATIVE_PRIORITY = (100 + 1) * TIER


def engine_priority(ingress: IngressConfig, tenant: str | None, hint: int | None) -> int:
    """vLLM's priority for a request of `tenant` whose `agent_hints.priority` is `hint`."""
    h = 0 if hint is None else max(-HINT_BOUND, min(HINT_BOUND, hint))
    return -(config_of(ingress, tenant).priority * TIER + h)


def cache_salt(ingress: IngressConfig, tenant: str | None) -> str | None:
    """The tenant's prefix-cache namespace for vLLM's `cache_salt`: its cache_group, else its own name. The
    default tenant stays unsalted (the shared cache it always had) unless it names a group."""
    name = tenant or DEFAULT
    group = config_of(ingress, name).cache_group
    if group is None and name == DEFAULT:
        return None
    # Clients cannot set a salt through any API here, so a readable name is as good as a secret one.
    return f"tenant-cache:{group or name}"


def names(ingress: IngressConfig) -> list[str]:
    """Every tenant a request can be served as: those the configured keys (and the open entry) lead to, the
    default tenant first. Keys are static configuration, so this is the whole set."""
    found = {DEFAULT} if not ingress.api_keys else set()
    for entry in ingress.api_keys:
        found.add(DEFAULT if isinstance(entry, str) else entry.tenant)
    return sorted(found, key=lambda n: (n != DEFAULT, n))


def routing_salts(ingress: IngressConfig) -> list[str | None]:
    """Every prefix-cache namespace a request can be served under: those of `names`, the default tenant's first,
    each once. The front door, which never sees a request's key, chooses among them (routing/front_door.py)."""
    salts: list[str | None] = []
    for name in names(ingress):
        salt = cache_salt(ingress, name)
        if salt not in salts:
            salts.append(salt)
    return salts


def allows(ingress: IngressConfig, tenant: str | None, model: ModelConfig) -> bool:
    allowed = config_of(ingress, tenant).models
    return allowed is None or bool(set(allowed) & set(model.all_ids))


def check_model(ingress: IngressConfig, tenant: str | None, model: ModelConfig) -> None:
    if not allows(ingress, tenant, model):
        raise ServiceError("permission", f"model: this API key may not use {model.id!r}", param="model",
                           code="model_not_allowed")
