"""RoutingTable: every engine deployment's routing state in one process, with no Ray in it.

One RouterCore per engine deployment (its KV index, loads and rates), the KV event feeds that keep each index, and
what each engine replica registered (its event endpoints and block size). Two processes hold one:

- the Router deployment (routing/deployment.py) is the control plane: engines register with it, the ingresses'
  Serve request routers report the replicas Serve routes to, an operator switches a policy there. With
  `router.placement: deployment` it also makes every decision (one Serve call per request).
- each Ingress replica, with `router.placement: ingress` (the default), holds its own table
  (routing/local.py) that follows the Router's `snapshot` and subscribes to the engines' KV events itself, so a
  decision is a function call in the process that needs it (docs/serving-path.md).
"""

from __future__ import annotations

import logging
from typing import Any

from serve_app.routing.core import RouterCore
from serve_app.routing.kv_events import KvFeeds
from serve_app.routing.membership import Registrations
from serve_app.routing.types import Decision, RouteRequest
from serve_app.settings import RouterConfig

log = logging.getLogger(__name__)


class RoutingTable:
    def __init__(self, config: RouterConfig, *, kv_events: bool | None = None):
        """`kv_events`: whether this table subscribes to the engines' KV events (default: the config's)."""
        self.config = config
        self.kv_events = config.kv_events if kv_events is None else kv_events
        self.cores: dict[str, RouterCore] = {}
        self.feeds: dict[str, KvFeeds] = {}
        # engine key -> what each replica registered (routing/membership.py: kept apart from the core's live set)
        self.registrations: dict[str, Registrations] = {}

    def core(self, engine_key: str, block_size: int | None = None) -> RouterCore:
        core = self.cores.get(engine_key)
        if core is None:
            core = RouterCore(policy=self.config.policy, block_size=block_size or 16, config=self.config)
            self.cores[engine_key] = core
            self.feeds[engine_key] = KvFeeds(core, enabled=self.kv_events)
        return core

    # ---- membership ----
    def register_replica(self, engine_key: str, replica_id: str, events_endpoint: str | None,
                         replay_endpoint: str | None, block_size: int, *, refresh: bool = False) -> None:
        """`refresh`: the engine repeating a registration it made before (it does so periodically, so a Router
        replica that restarted learns it again). A registration this table already holds is then left alone —
        its index, and a replica dropped from the running set stays dropped."""
        registration = (events_endpoint, replay_endpoint, block_size)
        regs = self.registrations.setdefault(engine_key, Registrations())
        if refresh and regs.get(replica_id) == registration:
            return
        regs.add(replica_id, registration)
        self.core(engine_key, block_size)
        self.feeds[engine_key].register(replica_id, events_endpoint, replay_endpoint, block_size)
        log.info("engine %s replica %s registered (block size %s)", engine_key, replica_id, block_size)

    def sync_replicas(self, engine_key: str, replica_ids: list[str]) -> None:
        """The replicas Serve routes to now: the others are dropped with their index, load and reservations;
        registered ones that reappear are re-registered."""
        core = self.core(engine_key)
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

    def drop_replica(self, engine_key: str, replica_id: str) -> None:
        """A call found `replica_id` dead: stop routing to it now, before the next membership report."""
        core = self.cores.get(engine_key)
        if core is not None and replica_id in core.loads:
            self.sync_replicas(engine_key, [r for r in core.loads if r != replica_id])

    def snapshot(self, engine_key: str) -> dict[str, Any]:
        """What a follower needs to route like this table: the live replicas, their registrations, the policy."""
        core = self.core(engine_key)
        regs = self.registrations.get(engine_key) or Registrations()
        live = list(core.loads)
        return {
            "policy": core.policy,
            "live": live,
            "registrations": {rid: list(reg) for rid in live if (reg := regs.get(rid)) is not None},
        }

    def follow(self, engine_key: str, snap: dict[str, Any]) -> None:
        """Apply the control plane's `snapshot`: the same live set, a feed per registration that is new or
        changed (an engine replica restarted with new ports), the same policy. Reservations and rates stay local."""
        regs = snap.get("registrations") or {}
        sizes = [r[2] for r in regs.values() if r[2]]
        core = self.core(engine_key, sizes[0] if sizes else None)
        if snap.get("policy") and snap["policy"] != core.policy:
            core.set_policy(snap["policy"])
        mine = self.registrations.setdefault(engine_key, Registrations())
        for rid, reg in regs.items():
            reg = tuple(reg)
            if mine.get(rid) != reg:
                self.register_replica(engine_key, rid, *reg)
        self.sync_replicas(engine_key, list(snap.get("live") or []))

    # ---- decisions ----
    def choose(self, engine_key: str, req: RouteRequest) -> Decision | None:
        core = self.core(engine_key)
        candidates = list(core.loads)
        if not candidates:
            return None
        return core.choose(req, candidates)

    def held_prefix(self, engine_key: str, hashes: list[int]) -> int:
        """The longest leading run of `hashes` that any live replica of the engine holds (0 before any has)."""
        core = self.cores.get(engine_key)
        if core is None or not core.loads or not hashes:
            return 0
        return max(core.index.overlaps(hashes, core.loads, core.now()).values())

    def mark_prefilled(self, engine_key: str, request_id: str, cached_tokens: int | None = None) -> None:
        """The request's first token exists: its prefill no longer loads the replica. `cached_tokens` (the
        engine's num_cached_tokens) lets the router measure the replica's prefill rate on what it computed."""
        core = self.cores.get(engine_key)
        if core is not None:
            core.mark_prefilled(request_id, cached_tokens)

    def redirect(self, engine_key: str, request_id: str, replica_id: str, restart: bool = False) -> bool:
        """The request was taken by `replica_id` instead of the replica chosen for it, or handed over there from
        a lost one (`restart`; RouterCore.redirect); whether its reservation moved."""
        core = self.cores.get(engine_key)
        return core is not None and core.redirect(request_id, replica_id, restart=restart)

    def release(self, engine_key: str, request_id: str, output_tokens: int | None = None) -> None:
        """The request ended; `output_tokens` generated (else the expected count stands in for the decode rate)."""
        core = self.cores.get(engine_key)
        if core is not None:
            core.release(request_id, output_tokens)

    def reconcile(self, engine_key: str, replica_id: str, running: dict[str, bool], *, older_than: float,
                  owned=lambda request_id: True) -> int:
        """What an engine replica says it runs now, for reports that went astray (RouterCore.reconcile)."""
        core = self.cores.get(engine_key)
        if core is None:
            return 0
        return core.reconcile(replica_id, running, older_than=older_than, owned=owned)

    def set_policy(self, engine_key: str, policy: str) -> None:
        self.core(engine_key).set_policy(policy)

    def metrics(self) -> dict:
        out = {key: self.feeds[key].metrics() for key in self.cores}
        for key, regs in self.registrations.items():
            if key in out:
                out[key]["registrations"] = regs.stats()
        return out

    async def close(self) -> None:
        for feeds in self.feeds.values():
            await feeds.close()
