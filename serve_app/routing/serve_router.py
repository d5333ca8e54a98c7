"""The Ray Serve request router of the Engine deployments; it runs inside each ingress process.

The routing decision itself is made by the Router deployment (shared KV index and load across all ingress
replicas) and arrives on the request as `target_replica`. This class only honours it, and falls back to Serve's
least-queue choice when there is no target (router unavailable) or the target has gone. It also keeps the
Router's view of live replicas current: every change of Serve's running set, and every replica whose actor a
call found dead (a node lost), is reported to the Router, which drops that replica's index, load and
reservations (routing/membership.py). The engine key comes from `request_router_kwargs` (app.py), the app name
from Serve.
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

log = logging.getLogger(__name__)

# How long a replica whose actor a call found unreachable (ActorUnavailableError: its node lost, not yet declared
# dead) is passed over while another replica remains. Serve keeps it among the candidates until the controller
# drops it, and as the least loaded one (its requests just failed) its own choice would send the retry straight
# back to it.
SUSPECT_S = 10.0


def _target_of(pending: Optional[PendingRequest]) -> str | None:
    if pending is None or not pending.args:
        return None
    return getattr(pending.args[0], "target_replica", None)


def _in_replica() -> bool:
    """Whether this request router runs in a Serve replica (an ingress). Only there does it report to the Router:
    in a driver (a test or an operator's script holding an engine handle) every handle's router shares one loop
    thread, and creating the Router's handle from that thread waits on the thread itself — a deadlock that hangs
    every later handle of the process."""
    from ray import serve

    try:
        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - RayServeException outside a replica
        return False
    return True


def _router_handle(app_name: str):
    from ray import serve

    return serve.get_deployment_handle("Router", app_name=app_name)


class TargetReplicaRouter(RequestRouter):
    def initialize_state(self, router_app: str | None = None, engine_key: str | None = None,
                         engine_keys: list[str] | None = None, **_):
        self._router_app = router_app or self.app_name  # the Router deployment is in the engines' app
        # An Engine deployment serves one engine key; an Ingress replica with the engines in it (the front door's
        # routing, routing/front_door_deployment.py) serves every engine key of the app.
        self._engine_keys = list(engine_keys or ([engine_key] if engine_key else []))
        self._router_handle = None
        self._suspects: dict[str, float] = {}  # replica id -> until when it is passed over

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        candidates = self._usable(candidate_replicas)
        target = _target_of(pending_request)
        if target is not None:
            for replica in candidates:
                if replica.replica_id.unique_id == target:
                    return [[replica]]
        # No usable target: one group of all candidates, and Serve takes the shortest queue (least loaded).
        return [candidates]

    def _usable(self, candidates: List[RunningReplica]) -> List[RunningReplica]:
        """The candidates without the suspects, unless that leaves none (then Serve's own retries decide)."""
        if not self._suspects:
            return candidates
        now = time.monotonic()
        self._suspects = {r: until for r, until in self._suspects.items() if until > now}
        live = [c for c in candidates if c.replica_id.unique_id not in self._suspects]
        return live or candidates

    def on_replica_actor_unavailable(self, replica_id) -> None:
        super().on_replica_actor_unavailable(replica_id)
        self._suspects[replica_id.unique_id] = time.monotonic() + SUSPECT_S

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = {r.replica_id.unique_id for r in replicas}
        self._suspects = {r: until for r, until in self._suspects.items() if r in ids}
        self._sync([r.replica_id.unique_id for r in replicas])

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)  # drops it from curr_replicas
        self._sync([r.replica_id.unique_id for r in self.curr_replicas.values() if r.replica_id != replica_id])

    def _reports(self) -> bool:
        return _in_replica()

    def _handle(self):
        return _router_handle(self._router_app)

    def _sync(self, ids: list[str]) -> None:
        if not self._router_app or not self._engine_keys or not self._reports():
            return
        try:
            if self._router_handle is None:
                self._router_handle = self._handle()
            for key in self._engine_keys:
                self._router_handle.sync_replicas.remote(key, ids)  # fire and forget
        except Exception as e:  # noqa: BLE001 - routing must go on; the next change of the set syncs again
            log.warning("could not report replicas to the Router: %s", e)
