"""The Ingress deployment: FastAPI on Ray Serve. Thin: it wires the GenerationService and the routes."""

from __future__ import annotations

import logging

from ray import serve

from serve_app.ingress.autoscaling import LISTENER_REQUESTS
from serve_app.ingress.clients import ServeEngineClient
from serve_app.keyring import KeyRing
from serve_app.routing.local import LocalRouter
from serve_app.ingress.context import build_context
from serve_app.ingress.listener import Listener
from serve_app.ingress.responses.store import open_local_store
from serve_app.ingress.server import create_app
from serve_app.serve_tuning import app_watches_disconnects, freeze_startup_heap
from serve_app.settings import AppSettings

log = logging.getLogger(__name__)


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    def __init__(self, settings: dict, secret: KeyRing, engines: dict, router=None, response_store=None,
                 tenant_limits=None):
        cfg = AppSettings.model_validate(settings)
        # Inert without direct ingress (only Serve's direct-ingress wrapper reads the header it overrides).
        if cfg.ingress.disconnects == "app" and not app_watches_disconnects():
            log.warning("ingress.disconnects: app has no effect with this Ray Serve: Serve watches disconnects")
        # With `router.placement: ingress` this replica routes from its own table (routing/local.py), following
        # the Router deployment. It starts here: the replica's code, handle calls and HTTP requests all run on
        # Serve's one event loop (serve_tuning.py), where the decisions are made.
        self.local_router = None
        self.listener = None  # with `ingress.listen`: the replica's own server, started with the app
        if router is not None and cfg.router.placement == "ingress":
            self.local_router = LocalRouter(cfg.router, router.options(_by_reference=False), list(engines))
            try:
                self.local_router.start()
            except RuntimeError:  # no running loop (outside Serve): the first request starts it
                pass
        self.local_engines = None
        if cfg.engine_placement == "ingress":
            # The engines run in this process (engine/local_client.py): no Engine deployment, no Router.
            from serve_app.engine.local_client import LocalEngineClient
            from serve_app.engine.stat_logger import EngineStatLogger

            replica = serve.get_replica_context()
            client = self.local_engines = LocalEngineClient.start(
                cfg.models, forced_scripts=cfg.testing.forced_scripts, model_cache_dir=cfg.model_cache_dir,
                replica_id=replica.replica_id.unique_id, stat_loggers=[EngineStatLogger],
                kv_events=cfg.router.front_door, restarts=cfg.engine_restarts)
            if cfg.router.front_door:
                # The front door's Router (routing/front_door_deployment.py) routes to this replica by what its
                # engines hold: they register their KV event feeds there, and each request it placed here
                # reports its prefill and end.
                import ray

                client.report_to(serve.get_deployment_handle("Router", app_name=replica.app_name),
                                 ray.util.get_node_ip_address())
        else:
            client = ServeEngineClient(engines, router, router_timeout_s=cfg.ingress.router_timeout_s,
                                       local=self.local_router)
        if response_store is None and cfg.ingress.response_store_placement == "ingress":
            response_store = open_local_store(cfg.ingress)
        # tenant_limits: the shared TenantLimits handle, when some tenant has limits
        self.ctx = build_context(cfg, secret, client, limits=tenant_limits, response_store=response_store,
                                 replica_tag=serve.get_replica_context().replica_tag)

    async def routing_metrics(self) -> dict:
        """This replica's routing table (placement `ingress`), as the Router deployment's `metrics()` reads;
        empty with placement `deployment`. Started here too, so a caller can wait for the table to fill."""
        if self.local_router is None:
            return {}
        self.local_router.start()
        return self.local_router.metrics()

    async def num_unfinished(self) -> int:
        """Requests the engines in this process still run (`engine_placement: ingress`; 0 otherwise)."""
        return await self.local_engines.num_unfinished() if self.local_engines is not None else 0

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric: the requests open on this replica's own port, which Serve does not
        carry and so cannot count (`ingress.listen`; ingress/autoscaling.py scales on it)."""
        return {LISTENER_REQUESTS: float(self.listener.open_requests)} if self.listener is not None else {}

    async def check_health(self) -> None:
        """Serve's periodic health check. With the engines in this process a dead engine is replaced in place while
        the others serve on (`engine_restarts`); one that cannot be (its replacement failed, or it keeps dying)
        fails the check, so Serve replaces the replica, engines and all, as it replaces a dead Engine replica in
        the other placement."""
        if self.local_engines is not None:
            await self.local_engines.check_health()

    async def __del__(self):
        # Serve's graceful shutdown: requests through this replica's own port (`ingress.listen`) are not Serve's
        # to count, so they are drained here, before the engines they stream from stop.
        if getattr(self, "listener", None) is not None:
            await self.listener.drain()
        if getattr(self, "local_engines", None) is not None:
            self.local_engines.shutdown()

    def __serve_build_asgi_app__(self):
        app = create_app(self.ctx)
        listen = self.ctx.settings.ingress.listen
        self.listener = None
        if listen is not None:
            # Runs on the replica's event loop (Serve calls this there), which the listener serves on.
            self.listener = Listener(app, listen.host, listen.port, listen.keep_alive_s, listen.drain_s)
            self.listener.start()
        # Last step of this replica's start-up: Serve builds the app after the constructor, so the heap is frozen
        # here once, tokenizers, routes and models together.
        freeze_startup_heap()
        return app
