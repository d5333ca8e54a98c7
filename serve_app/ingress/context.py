"""What every route module gets: the settings, the GenerationService and the shared pieces, on the app's state.

A routes module exposes `router` (ingress/envelope.py `api_router`); its handlers take
`ctx: IngressContext = Depends(get_ctx)`. `serve_app/ingress/server.py` builds the FastAPI app, sets
`app.state.ctx` and includes every router.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from starlette.requests import Request

from serve_app.keyring import KeyRing
from serve_app.service import GenerationService
from serve_app.settings import AppSettings


class RecordStore(Protocol):
    """A key -> record store shared by every ingress replica (the Responses store: responses/store.py)."""

    async def put(self, key: str, record: Any, parent: str | None = None) -> bool: ...

    async def get(self, key: str) -> Any | None: ...

    async def chain(self, key: str) -> list[Any] | None: ...

    async def delete(self, key: str) -> bool: ...


@dataclass
class IngressContext:
    settings: AppSettings
    service: GenerationService
    secret: KeyRing  # server keys: sign thinking blocks, encrypt Responses reasoning (serve_app/keyring.py)
    response_store: RecordStore | None = None  # None: `store` and `previous_response_id` are unavailable
    replica_tag: str = ""  # this ingress replica's name, sent as `x-serve-replica` ("" outside Serve)
    # The front door's Router parses bodies only to route them and sees no API key: a stored history is read
    # whoever's it is, for its hashes alone (routing/front_door.py); the ingress then checks the owner.
    routing_only: bool = False

    def tenant(self) -> str | None:
        """The current request's tenant, set by the route's key check; None at the front door, which only
        routes (`routing_only`)."""
        from serve_app import tenants

        return None if self.routing_only else tenants.CURRENT.get() or tenants.DEFAULT

    def tenant_secret(self) -> KeyRing:
        """The keys the current request's tenant signs and seals with and verifies and opens with
        (keyring.for_tenant): what another tenant was given does not open here. The front door's Router, which
        knows no tenant, opens any tenant's, for the hashes alone."""
        from serve_app import keyring, tenants

        tenant, server_keys = self.tenant(), self.settings.ingress.accept_server_key_items
        if tenant is None:
            return keyring.for_tenants(self.secret, tenants.names(self.settings.ingress), server_keys)
        return keyring.for_tenant(self.secret, tenant, server_keys)


def build_context(cfg: AppSettings, secret: KeyRing, engines: Any, *, limits: Any = None, response_store: Any = None,
                  replica_tag: str = "") -> IngressContext:
    """An ingress's context over its engine client: the one assembly of the Serve replica (ingress/deployment.py)
    and of the single-process server (serve_app/single_process.py). `limits`: the shared limit state (a
    TenantLimits handle, or a LimitState in one process), None when no tenant has limits; `response_store`: a store
    deployment's handle or a store in this process, None when there is none."""
    from serve_app.ingress.limits import LimitClient
    from serve_app.ingress.responses.store import StoreClient

    service = GenerationService(cfg, engines, limiter=LimitClient(limits) if limits is not None else None)
    # Tokenizers load here, one after another: building them lazily from several request threads at once raced
    # inside transformers' lazy imports.
    service.warm_renderers()
    store = (StoreClient(response_store, cfg.ingress.response_store_timeout_s,
                         recent_bytes=cfg.ingress.response_store_recent_bytes)
             if response_store is not None else None)
    return IngressContext(settings=cfg, service=service, secret=secret, response_store=store,
                          replica_tag=replica_tag)


def replica_headers(ctx: IngressContext) -> dict[str, str]:
    """`x-serve-replica`: which ingress replica answered (lets tests and operators see cross-replica use, and
    which replica the front door chose)."""
    return {"x-serve-replica": ctx.replica_tag} if ctx.replica_tag else {}


async def get_ctx(request: Request) -> IngressContext:
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread hop per request (and anyio's
    # root-task lookup walks every task on the loop: O(open streams) each time).
    return request.app.state.ctx
