"""The Router deployment: the routing control plane, one replica per app (routing/table.py).

Engines register their KV event endpoints here and the ingresses' Serve request routers report the replicas Serve
routes to; an operator switches a policy here. With `router.placement: ingress` (the default) each Ingress replica
follows this table's `snapshot` and decides locally (routing/local.py), so this replica subscribes to no KV
events; with `placement: deployment` it decides every request (`choose`) from its own feeds.
"""

from __future__ import annotations

from ray import serve

from serve_app.routing.table import RoutingTable
from serve_app.routing.types import Decision, RouteRequest
from serve_app.serve_tuning import freeze_startup_heap
from serve_app.settings import RouterConfig


class RouterMethods:
    """The Router's Serve methods over `self.table`; shared with the front door's Router
    (routing/front_door_deployment.py)."""

    table: RoutingTable

    async def register_replica(self, engine_key: str, replica_id: str, events_endpoint, replay_endpoint,
                               block_size: int, refresh: bool = False):
        self.table.register_replica(engine_key, replica_id, events_endpoint, replay_endpoint, block_size,
                                    refresh=refresh)

    async def sync_replicas(self, engine_key: str, replica_ids: list[str]) -> None:
        self.table.sync_replicas(engine_key, replica_ids)

    async def snapshot(self, engine_key: str) -> dict:
        return self.table.snapshot(engine_key)

    async def choose(self, engine_key: str, req: RouteRequest) -> Decision | None:
        return self.table.choose(engine_key, req)

    async def mark_prefilled(self, engine_key: str, request_id: str, cached_tokens: int | None = None) -> None:
        self.table.mark_prefilled(engine_key, request_id, cached_tokens)

    async def set_policy(self, engine_key: str, policy: str) -> None:
        """Switch one engine's routing policy at run time (operations and side-by-side tests); the KV index and
        loads are kept. Ingress-local tables take it from the next snapshot."""
        self.table.set_policy(engine_key, policy)

    async def redirect(self, engine_key: str, request_id: str, replica_id: str, restart: bool = False) -> None:
        self.table.redirect(engine_key, request_id, replica_id, restart)

    async def release(self, engine_key: str, request_id: str, output_tokens: int | None = None) -> None:
        self.table.release(engine_key, request_id, output_tokens)

    async def metrics(self) -> dict:
        return self.table.metrics()


@serve.deployment(name="Router", num_replicas=1, max_ongoing_requests=10_000)
class Router(RouterMethods):
    def __init__(self, config: dict):
        cfg = RouterConfig.model_validate(config)
        self.table = RoutingTable(cfg, kv_events=cfg.kv_events and cfg.placement == "deployment")
        freeze_startup_heap()  # with placement `deployment` every request's decision waits on this loop
