"""The Router deployment: one RouterCore per engine deployment, shared by every ingress replica, and the KV event
feeds (ZMQ subscribers) that keep each core's index."""

from __future__ import annotations

import logging

from ray import serve

from serve_app.routing.core import RouterCore
from serve_app.routing.kv_events import KvFeeds
from serve_app.routing.membership import Registrations
from serve_app.routing.types import Decision, RouteRequest
from serve_app.settings import RouterConfig

log = logging.getLogger(__name__)


@serve.deployment(name="Router", num_replicas=1, max_ongoing_requests=10_000)
class Router:
    def __init__(self, config: dict):
        self.config = RouterConfig.model_validate(config)
        self.cores: dict[str, RouterCore] = {}
        self.feeds: dict[str, KvFeeds] = {}
        # engine key -> what each replica registered (routing/membership.py: kept apart from the core's live set)
        self.registrations: dict[str, Registrations] = {}

    def _core(self, engine_key: str, block_size: int | None = None) -> RouterCore:
        core = self.cores.get(engine_key)
        if core is None:
            core = RouterCore(policy=self.config.policy, block_size=block_size or 16, config=self.config)
            self.cores[engine_key] = core
            self.feeds[engine_key] = KvFeeds(core, enabled=self.config.kv_events)
        return core

    async def register_replica(self, engine_key: str, replica_id: str, events_endpoint, replay_endpoint, block_size: int):
        self.registrations.setdefault(engine_key, Registrations()).add(
            replica_id, (events_endpoint, replay_endpoint, block_size))
        self._core(engine_key, block_size)
        self.feeds[engine_key].register(replica_id, events_endpoint, replay_endpoint, block_size)
        log.info("engine %s replica %s registered (block size %s)", engine_key, replica_id, block_size)

    async def sync_replicas(self, engine_key: str, replica_ids: list[str]) -> None:
        """The replicas Serve routes to now (from an ingress's request router): the others are dropped with
        their index, load and reservations; registered ones that reappear are re-registered."""
        core = self._core(engine_key)
        feeds = self.feeds[engine_key]
        known = set(core.loads)
        core.sync_replicas(replica_ids)
        feeds.retain()
        regs = self.registrations.setdefault(engine_key, Registrations())
        for rid, registration in regs.reconcile(replica_ids, known):
            feeds.register(rid, *registration)
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
        if core is not None:
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
        out = {key: self.feeds[key].metrics() for key in self.cores}
        for key, regs in self.registrations.items():
            if key in out:
                out[key]["registrations"] = regs.stats()
        return out
