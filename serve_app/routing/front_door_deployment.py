"""The Router with `router.front_door`: Serve's HAProxy asks it, per request, which ingress replica to forward to.

The routing control plane of routing/deployment.py (policy, metrics), named `Router` too, plus the HTTP hook Serve's
HAProxy calls before forwarding a request (Serve's "ingress request router", `Application.
_with_ingress_request_router`): `POST /internal/route` with the client's body, answered `{"replica_id", "host",
"port"}` of the ingress replica to forward to. The ingress replicas run the engines (`engine_placement:
ingress`).

The ingress replicas register their engines' KV event endpoints here, as Engine replicas do with the Router of
the other placement, and the Serve request router of this replica's handle to the Ingress deployment reports
the live ingress replicas (routing/serve_router.py). A request's route id, `<this replica>/<x-request-id>`, goes
to the ingress in a trusted header (HAProxy strips client-sent `x-serve-router-*` headers before applying it), and
the ingress reports the request's prefill and end under it.

Serve runs one replica of this deployment per proxy node. With one (`proxy_location: HeadOnly`, every CPU config
here) the table is exact. With several, each handle call reaches one of them: the ingresses repeat their
registrations every few seconds so every replica learns them; a report reaches the replica that placed the request
only by chance (the others ignore it), so each registration also lists the route ids the ingress runs now and a
replica releases its own reservations there that are no longer listed (older than RECONCILE_AFTER_S): its loads
lag by up to that plus a few registration periods instead of reading high until the reservations expire;
membership changes reach one replica, and a request placed on a replica that has gone falls back to Serve's
choice (counted in `fallbacks`).

A reservation is made for the answer, before HAProxy forwards anything, so every way the answer can go unused
releases it at once instead of leaving the replica loaded with a phantom prefill until reconcile: an answer later
than HAProxy waits (it then answers 503 itself) or cancelled; a request the ingress received but never ran
through an engine (count_tokens, an auth or limit error, a client gone before generation: `abandoned`); and a
pin-miss, where HAProxy's replica map lacks the chosen replica (right after a deploy or scale-up) and Serve's
fallback proxy delivers the request elsewhere without its route id (`unrouted`, by the x-request-id HAProxy set).
Where Serve's handle here answers with another replica than the chosen one, the reservation moves there
(RouterCore.redirect) and the request keeps its route id.
Which body becomes which prompt: routing/front_door.py; a Responses continuation's history comes from the same
Responses store the ingress reads (`history_reader`).
"""

from __future__ import annotations

import logging
import time

from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

from serve_app import metrics
from serve_app.keyring import KeyRing
from serve_app.routing.deployment import RouterMethods
from serve_app.routing.front_door import FrontDoor, HistoryReader
from serve_app.routing.table import RoutingTable
from serve_app.routing.types import ROUTE_ID_HEADER, Decision
from serve_app.serve_tuning import freeze_startup_heap
from serve_app.settings import AppSettings

log = logging.getLogger(__name__)

ROUTE_PATH = "/internal/route"
# A reservation younger than this is never taken for ended by an ingress's registration (the request may not have
# reached the ingress's engine yet); an older one its ingress no longer runs is released.
RECONCILE_AFTER_S = 30.0


def hook_timeout_s() -> float:
    """How long HAProxy's Lua waits for the hook's answer before it gives up on it (Serve's setting)."""
    try:
        from ray.serve._private.constants import RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_TIMEOUT_S as timeout
    except ImportError:  # a Serve without it: its documented default
        timeout = 5
    return float(timeout)


def history_reader(cfg: AppSettings, response_store, hook_timeout: float) -> HistoryReader | None:
    """The Responses store the ingress reads `previous_response_id` histories from, for the front door to render
    a continuation's whole prompt: the store deployment's handle, or the database opened here as each ingress
    replica opens it (`response_store_placement: ingress`). A read gets at most half of HAProxy's wait, leaving the
    rest for rendering and choosing."""
    from serve_app.ingress.responses.store import StoreClient, open_local_store

    if response_store is None and cfg.ingress.response_store_placement == "ingress":
        response_store = open_local_store(cfg.ingress)
    if response_store is None:
        return None
    timeout = cfg.ingress.response_store_timeout_s
    # It keeps the records it reads as an ingress keeps those it stores (ingress/responses/recent.py): a session's
    # next turn then costs it one record's read, not the whole chain's.
    client = StoreClient(response_store, timeout, recent_bytes=cfg.ingress.response_store_recent_bytes)
    return HistoryReader(client, min(timeout, hook_timeout / 2))


def decision_outcome(decision: Decision | None, went_to_target: bool) -> tuple[str, str]:
    """`router_decisions_total`'s (policy, outcome) for one front-door answer, as the ingress records the Engine
    placement's decisions (ingress/clients.py), so the dashboard's routing panel reads the same in both."""
    if decision is None:  # a body without a key (unreadable, unknown model, history not read) or no request id
        return "fallback", "no_decision"
    if not went_to_target:
        return "fallback", "replica_gone"
    return decision.policy, decision.outcome


class Target:
    """What TargetReplicaRouter (routing/serve_router.py) reads the replica a call must go to from."""

    __slots__ = ("target_replica",)

    def __init__(self, target_replica: str | None):
        self.target_replica = target_replica


@serve.deployment(name="Router", max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
class FrontDoorRouter(RouterMethods):
    def __init__(self, settings: dict, secret: KeyRing, ingress, response_store=None):
        """`response_store`: the ResponseStore deployment the ingress calls, None when each ingress replica opens
        the store itself (then this replica opens it too) or there is none."""
        cfg = AppSettings.model_validate(settings)
        self.table = RoutingTable(cfg.router, kv_events=cfg.router.kv_events)
        self.timeout_s = hook_timeout_s()
        self.door = FrontDoor(cfg, secret, self._block_size, history_reader(cfg, response_store, self.timeout_s),
                              held_prefix=self.table.held_prefix)
        self.door.warm()
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self._ingress = ingress
        self._ingress._init()  # its request router reports the live ingress replicas from now on
        self.decisions = self.fallbacks = 0
        # Reservations released because the answer went unused: too late or cancelled, received but never run
        # through an engine, delivered elsewhere by Serve's fallback proxy (module docstring).
        self.late = self.abandoned_requests = self.pin_misses = 0
        self.route_ms = 0.0
        freeze_startup_heap()

    def _block_size(self, engine_key: str) -> int | None:
        regs = self.table.registrations.get(engine_key)
        if regs is None or not regs.stats()["registered"]:
            return None
        return self.table.cores[engine_key].block_size

    # ---- the ingress's reports ----
    def _mine(self, route_id: str) -> bool:
        return route_id.partition("/")[0] == self.replica_id

    async def register_replica(self, engine_key: str, replica_id: str, events_endpoint, replay_endpoint,
                               block_size: int, refresh: bool = False, running: dict[str, bool] | None = None):
        """An ingress replica's periodic registration, with the route ids its engine runs now (`running`: id ->
        prefilled). Reservations of this replica's that it no longer runs have ended even if their reports went
        to another Router replica; only those older than RECONCILE_AFTER_S, so that a request still on its way
        from HAProxy to the ingress (body, parse, render) is not taken for ended."""
        await super().register_replica(engine_key, replica_id, events_endpoint, replay_endpoint, block_size,
                                       refresh=refresh)
        if running is not None:
            core = self.table.cores.get(engine_key)
            if core is not None:
                self.table.reconcile(engine_key, replica_id, running, owned=self._mine,
                                     older_than=core.now() - RECONCILE_AFTER_S)

    async def prefilled(self, engine_key: str, route_id: str, cached_tokens: int | None = None) -> None:
        if self._mine(route_id):
            self.table.mark_prefilled(engine_key, route_id, cached_tokens)

    async def released(self, engine_key: str, route_id: str, output_tokens: int | None = None) -> None:
        if self._mine(route_id):
            self.table.release(engine_key, route_id, output_tokens)

    async def abandoned(self, route_id: str) -> None:
        """The ingress received this request but never ran it through an engine (nothing else will report it)."""
        if self._mine(route_id) and self._drop(route_id):
            self.abandoned_requests += 1

    async def unrouted(self, request_id: str) -> None:
        """A request arrived at an ingress without its route id: if this replica placed it, the pin was missed
        and it is served elsewhere, by Serve's choice."""
        route_id = f"{self.replica_id}/{request_id}"
        for core in self.table.cores.values():  # one walk: the core holding it says whether it moved, then drops it
            moved = core.redirected(route_id)
            if core.release(route_id, measured=False, unused=True):
                break
        else:
            return
        self.pin_misses += 1
        if moved:  # its answer was counted as a fallback already
            return
        self.fallbacks += 1
        self.decisions -= 1
        # The answer was counted as a decision under its policy, and a counter cannot be taken back: a
        # `fallback`/`pin_miss` sample lets a dashboard subtract it (docs/operations.md).
        metrics.observe_router_decision("fallback", "pin_miss")

    def _drop(self, route_id: str) -> bool:
        """Release `route_id`'s reservation in whichever engine's core holds it; not a measurement."""
        return any(core.release(route_id, measured=False, unused=True) for core in self.table.cores.values())

    # ---- HAProxy's hook ----
    async def __call__(self, request: Request):
        path = request.url.path.rstrip("/")
        if request.method == "POST" and path.endswith(ROUTE_PATH):
            return await self.route(request)
        if path.endswith("/health"):
            return PlainTextResponse("ok")
        return PlainTextResponse("not found", status_code=404)

    async def route(self, request: Request) -> JSONResponse:
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or ""
        session_id = request.headers.get("x-session-id") or request.headers.get("x_session_id")
        route_id = f"{self.replica_id}/{request_id}"
        routed = await self.door.route_request(await request.body(), request, route_id, session_id)
        decision = None
        if routed.engine_key is not None and request_id:
            decision = self.table.choose(routed.engine_key, routed.request)
        target = decision.replica_id if decision is not None else None
        try:
            answer = await self._answer(routed, decision, target, route_id, request_id)
        except BaseException:  # cancelled (HAProxy gave up, Serve shutting down): nobody forwards it
            if decision is not None:
                self._unreserve(routed.engine_key, route_id)
            raise
        elapsed = time.perf_counter() - started
        if decision is not None and elapsed >= self.timeout_s and self._unreserve(routed.engine_key, route_id):
            # HAProxy stopped waiting and answered the client 503 itself: this answer is never used.
            self.late += 1
        self.route_ms += elapsed * 1000
        return answer

    async def _answer(self, routed, decision: Decision | None, target: str | None, route_id: str,
                      request_id: str) -> JSONResponse:
        try:
            # Serve's own choice among the live ingress replicas when there is no decision (least loaded) or the
            # chosen one has just gone; no slot is reserved there: the request itself goes through HAProxy.
            async with self._ingress.choose_replica(Target(target), _reserve=False) as selection:
                replica = selection._replica
                endpoint = replica.backend_http_endpoint
                if endpoint is None:
                    raise RuntimeError(f"ingress replica {replica.replica_id} has no HTTP endpoint")
                host, port = endpoint
                chosen = replica.replica_id
        except Exception as e:  # noqa: BLE001 - HAProxy answers 503 for any non-200
            if decision is not None:
                self._unreserve(routed.engine_key, route_id)
            log.warning("front door: no ingress replica for request %s: %s", request_id, e)
            metrics.observe_router_decision("fallback", "no_replica")
            return JSONResponse({"detail": str(e)[:300]}, status_code=503)
        answer = {"replica_id": chosen.to_full_id_str(), "host": host, "port": port}
        metrics.observe_router_decision(*decision_outcome(decision, chosen.unique_id == target))
        reserved = decision is not None
        if decision is None or chosen.unique_id != target:
            self.fallbacks += 1
            # Going elsewhere: its reservation follows it where the table has that replica, so its load and
            # placement are counted where it runs; else nothing will report it.
            if reserved and not self.table.redirect(routed.engine_key, route_id, chosen.unique_id):
                self._unreserve(routed.engine_key, route_id)
                reserved = False
        else:
            self.decisions += 1
        # Whoever serves it reports its prefill and end under this id, to this replica. Nothing reserved: an empty
        # route id tells the ingress so. A request arriving with no route id at all was not forwarded on an answer
        # of ours (a pin-miss), and the ingress reports it (`unrouted`).
        answer["request_headers"] = {ROUTE_ID_HEADER: route_id if reserved else ""}
        return JSONResponse(answer)

    def _unreserve(self, engine_key: str, route_id: str) -> bool:
        """Drop a reservation no request will report on (not a measurement of the replica, which never ran
        it); whether one was held."""
        core = self.table.cores.get(engine_key)
        return core is not None and core.release(route_id, measured=False, unused=True)

    async def front_door_metrics(self) -> dict:
        """Requests routed by this table's decision / by Serve's fallback; with / without their prefix's hashes;
        prompts held alike under several tenants' cache namespaces (the first was taken, routing/front_door.py);
        time spent answering the hook; engines registered here (one per engine per ingress replica); reservations
        released because their ingress no longer ran them (their end reported elsewhere, or never); and those
        released because the answer went unused: too late for HAProxy or cancelled (`late`), received but never
        run through an engine (`abandoned`), delivered elsewhere by Serve's fallback proxy (`pin_misses`, also
        counted in `fallbacks`)."""
        return {"decisions": self.decisions, "fallbacks": self.fallbacks, "keyed": self.door.keyed,
                "unkeyed": self.door.unkeyed, "namespace_ties": self.door.namespace_ties,
                "namespace_ties_by_user": self.door.namespace_ties_by_user,
                "route_ms_total": round(self.route_ms, 1),
                "registered_replicas": sum(r.stats()["registered"] for r in self.table.registrations.values()),
                "reconciled": sum(c.reconciled_reservations for c in self.table.cores.values()),
                "late": self.late, "abandoned": self.abandoned_requests, "pin_misses": self.pin_misses}
