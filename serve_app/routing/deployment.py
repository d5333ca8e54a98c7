"""The Router deployment: one RouterCore per engine deployment, shared by every ingress replica."""

from __future__ import annotations

import logging

from ray import serve

from serve_app.routing.core import Decision, RouteRequest, RouterCore
from serve_app.routing.membership import Registrations
from serve_app.settings import RouterConfig

log = logging.getLogger(__name__)


@serve.deployment(name="Router", num_replicas=1, max_ongoing_requests=10_000)
class Router:
    def __init__(self, config: dict):
        self.config = RouterConfig.model_validate(config)
        self.cores: dict[str, RouterCore] = {}
        # engine key -> what each replica registered (routing/membership.py: kept apart from the core's live set)
        self.registrations: dict[str, Registrations] = {}

    def _core(self, engine_key: str, block_size: int | None = None) -> RouterCore:
        core = self.cores.get(engine_key)
        if core is None:
            core = _make_core(self.config, block_size or 16)
            self.cores[engine_key] = core
        return core

    async def register_replica(self, engine_key: str, replica_id: str, events_endpoint, replay_endpoint, block_size: int):
        self.registrations.setdefault(engine_key, Registrations()).add(
            replica_id, (events_endpoint, replay_endpoint, block_size))
        core = self._core(engine_key, block_size)
        register = getattr(core, "register_replica", None)
        if register is not None:
            result = register(replica_id, events_endpoint, replay_endpoint, block_size)
            if hasattr(result, "__await__"):
                await result
        else:
            core.sync_replicas(list({*core.loads, replica_id}))
        log.info("engine %s replica %s registered (block size %s)", engine_key, replica_id, block_size)

    async def sync_replicas(self, engine_key: str, replica_ids: list[str]) -> None:
        """The replicas Serve routes to now (from an ingress's request router): the others are dropped with
        their index, load and reservations; registered ones that reappear are re-registered."""
        core = self._core(engine_key)
        known = set(core.loads)
        core.sync_replicas(replica_ids)
        regs = self.registrations.setdefault(engine_key, Registrations())
        for rid, registration in regs.reconcile(replica_ids, known):
            core.register_replica(rid, *registration)
        gone = known - set(replica_ids)
        if gone:
            log.info("engine %s: replicas %s left the routing set", engine_key, sorted(gone))

    async def choose(self, engine_key: str, req: RouteRequest) -> Decision | None:
        core = self._core(engine_key)
        candidates = list(core.loads)
        if not candidates:
            return None
        return core.choose(req, candidates)

    async def mark_prefilled(self, engine_key: str, request_id: str, cached_tokens: int | None = None) -> None:
        """The request's first token exists: its prefill no longer loads the replica. `cached_tokens` (the
        engine's num_cached_tokens) lets the router measure the replica's prefill rate on what it computed."""
        core = self.cores.get(engine_key)
        if core is not None and hasattr(core, "mark_prefilled"):
            core.mark_prefilled(request_id, cached_tokens)

    async def set_policy(self, engine_key: str, policy: str) -> None:
        """Switch one engine's routing policy at run time (operations and side-by-side tests); the KV index and
        loads are kept."""
        self._core(engine_key).set_policy(policy)

    async def release(self, engine_key: str, request_id: str, output_tokens: int | None = None) -> None:
        """The request ended; `output_tokens` generated (else the expected count stands in for the decode rate)."""
        core = self.cores.get(engine_key)
        if core is not None:
            core.release(request_id, output_tokens)

    async def metrics(self) -> dict:
        out = {key: core.metrics() for key, core in self.cores.items()}
        for key, regs in self.registrations.items():
            if key in out:
                out[key]["registrations"] = regs.stats()
        return out


def _make_core(config: RouterConfig, block_size: int) -> RouterCore:
    try:
        return RouterCore(policy=config.policy, block_size=block_size, config=config)
    except TypeError:  # the simple core takes no config
        return RouterCore(policy=config.policy, block_size=block_size)
