"""The server key ring: new signatures and sealed items use the newest key, every listed key still verifies.

Thinking-block signatures and Responses `encrypted_content` are only as durable as the key: a key that changes on
restart breaks every session a client holds. So the key comes from `ingress.server_secret` or the
SERVE_APP_SERVER_SECRET environment variable (a Kubernetes Secret in kuberay/), and a list of keys (newest first)
lets an operator rotate: add the new key in front, keep the old one until the sessions it signed are over.

`KeyRing` IS the newest key as `bytes`, so code that signs (`ThinkingSigner(secret)`, `ReasoningSealer(secret)`)
takes it unchanged; code that verifies iterates `keys_of(secret)`.

What a tenant is given is its own (`for_tenant`): each server key is derived for the tenant, as OpenAI binds
`encrypted_content` to the organisation, so another tenant's sealed reasoning does not open into a prompt of
yours. The server keys themselves stay last in every tenant's ring, to verify and open only: they signed
everything before tenants had keys of their own, so sessions go on across the upgrade (and across a rolling
deploy's older replicas). `ingress.accept_server_key_items: false` leaves them out once those sessions are over.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets as _secrets
from typing import Iterable

log = logging.getLogger(__name__)

ENV = "SERVE_APP_SERVER_SECRET"


class KeyRing(bytes):
    """The newest key (its bytes value) with every key that still verifies in `.keys`, newest first."""

    keys: tuple[bytes, ...]

    def __new__(cls, keys: Iterable[bytes]):
        ring = tuple(keys)
        if not ring:
            raise ValueError("a key ring needs at least one key")
        obj = super().__new__(cls, ring[0])
        obj.keys = ring
        return obj

    def __reduce__(self):  # crosses Ray as a ring, not as its first key
        return (KeyRing, (self.keys,))

    def __repr__(self) -> str:  # never print key material
        return f"KeyRing(<{len(self.keys)} keys>)"


def keys_of(secret: bytes) -> tuple[bytes, ...]:
    return secret.keys if isinstance(secret, KeyRing) else (secret,)


def for_tenant(secret: bytes, tenant: str, server_keys: bool = True) -> KeyRing:
    """`tenant`'s ring: the server keys derived for it (newest first, the newest signs), then, with
    `server_keys`, the server keys (module docstring)."""
    return for_tenants(secret, (tenant,), server_keys)


@functools.lru_cache(maxsize=256)
def _derived(keys: tuple[bytes, ...], tenants: tuple[str, ...], server_keys: bool) -> KeyRing:
    derived = [hmac.new(key, b"serve_app tenant key\x00" + tenant.encode("utf-8"), hashlib.sha256).digest()
               for tenant in tenants for key in keys]
    return KeyRing([*derived, *keys] if server_keys else derived)


def for_tenants(secret: bytes, tenants: Iterable[str], server_keys: bool = True) -> KeyRing:
    """A ring that verifies and opens what any of `tenants` was given (the front door's Router renders any
    tenant's prompt to route it and never signs); its newest key is the first tenant's."""
    return _derived(keys_of(secret), tuple(tenants), server_keys)


def _split(value: str) -> list[str]:
    return [k.strip() for k in value.split(",") if k.strip()]


def load(configured: str | list[str] | None, *, environ=os.environ, warn: bool = True) -> KeyRing:
    """The ring from config, else the environment (comma-separated, newest first), else one random key with a
    warning (`warn=False` for test configs)."""
    keys = [configured] if isinstance(configured, str) else list(configured or [])
    keys = [k for k in keys if k]
    if not keys and environ.get(ENV):
        keys = _split(environ[ENV])
    if not keys:
        if warn:
            log.warning("ingress.server_secret is not set (nor %s): using a random key for this deploy, so "
                        "thinking signatures and Responses encrypted_content will not verify after a restart or "
                        "an upgrade; set it from a secret", ENV)
        keys = [_secrets.token_hex(32)]
    return KeyRing(k.encode() for k in keys)
