"""The ingress's own routing table (`router.placement: ingress`): decisions without a Serve call per request.

A RoutingTable in the Ingress process subscribes to every engine replica's KV events itself and follows the Router
deployment's `snapshot` (the live replicas, their registrations, the policy) every `sync_interval_s`. A decision,
the prefill mark and the release are then function calls on the ingress's event loop, where before each was a
Serve round trip (docs/serving-path.md, "Where the time to first token goes"). Load, reservations and the measured
rates are this ingress's own: exact with one ingress replica, each replica's share with several (the KV index,
from the engines' events, is the same in all).

Everything runs on the one event loop that first uses the router (the ingress's request loop): the follower task,
the KV event subscribers and the decisions, so the table needs no lock.
"""

from __future__ import annotations

import asyncio
import logging

from serve_app.routing.table import RoutingTable
from serve_app.routing.types import Decision, RouteRequest
from serve_app.settings import RouterConfig

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0


class LocalRouter:
    def __init__(self, config: RouterConfig, control, engine_keys: list[str]):
        """`control`: the Router deployment's handle (anything whose `snapshot.remote(key)` can be awaited)."""
        self.table = RoutingTable(config)
        self._control = control
        self._keys = list(engine_keys)
        self._interval = config.sync_interval_s
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._synced = asyncio.Event()
        self.syncs = 0
        self.sync_failures = 0
        self._failing = False
        self._warned_loop = False

    def start(self) -> None:
        """Start following (idempotent); call on the loop that will make the decisions."""
        if self._task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._follow())

    async def _follow(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._interval)

    async def refresh(self) -> None:
        """Take the control plane's current snapshot of every engine; a failed call keeps the last one."""
        ok = True
        for key in self._keys:
            try:
                snap = await asyncio.wait_for(self._control.snapshot.remote(key), SNAPSHOT_TIMEOUT_S)
                core = self.table.cores.get(key)
                if not snap.get("live") and core is not None and core.loads:
                    # A Router replica that restarted knows no replicas until Serve's running set next changes;
                    # keep routing on what this table knows (a replica that really went fails its call and is
                    # dropped here then, clients.py).
                    continue
                self.table.follow(key, snap)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - routing goes on from the last membership
                ok = False
                self.sync_failures += 1
                if not self._failing:
                    log.warning("could not follow the Router for %s (%s); routing on the last membership",
                                key, type(e).__name__)
        if ok and self._failing:
            log.info("following the Router again")
        self._failing = not ok
        self.syncs += 1
        self._synced.set()

    async def ready(self, timeout_s: float) -> bool:
        """Started, and one snapshot applied (or `timeout_s` passed): the first request after start-up gets a
        decision rather than Serve's least-loaded fallback."""
        self.start()
        if not self._synced.is_set():
            try:
                await asyncio.wait_for(self._synced.wait(), timeout_s)
            except asyncio.TimeoutError:
                return False
        return True

    def choose(self, engine_key: str, req: RouteRequest) -> Decision | None:
        if self._loop is not None and not self._warned_loop and asyncio.get_running_loop() is not self._loop:
            # The table has no lock: it must live on one loop. Serve runs handle calls and HTTP requests on the
            # replica's one user-code loop; say so loudly if that ever changes.
            self._warned_loop = True
            log.error("routing decisions on another event loop than the routing table's follower")
        return self.table.choose(engine_key, req)

    def mark_prefilled(self, engine_key: str, request_id: str, cached_tokens: int | None = None) -> None:
        self.table.mark_prefilled(engine_key, request_id, cached_tokens)

    def redirect(self, engine_key: str, request_id: str, replica_id: str, restart: bool = False) -> None:
        self.table.redirect(engine_key, request_id, replica_id, restart)

    def release(self, engine_key: str, request_id: str, output_tokens: int | None = None) -> None:
        self.table.release(engine_key, request_id, output_tokens)

    def drop_replica(self, engine_key: str, replica_id: str) -> None:
        self.table.drop_replica(engine_key, replica_id)

    def knows_live(self, engine_key: str) -> bool:
        """Whether this table still lists a replica of the engine (an unknown engine: assume one)."""
        core = self.table.cores.get(engine_key)
        return core is None or bool(core.loads)

    def metrics(self) -> dict:
        out = self.table.metrics()
        for key in out:
            out[key]["follower"] = {"syncs": self.syncs, "sync_failures": self.sync_failures}
        return out

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        await self.table.close()
