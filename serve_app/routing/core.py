"""RouterCore: the routing state and decision, free of Ray so it can be unit-tested and simulated.

The Router deployment wraps one RouterCore per engine deployment; the Serve request router (in each ingress
process) asks it for a replica per request. Every decision reserves load on the chosen replica (prefill tokens
until `mark_prefilled`, expected output tokens until `release`), so a burst of requests does not all land on
the replica that looked best at the start of the burst.

The KV index per replica is fed by the engine's KV events or, without a healthy feed, predicted from the
router's own decisions with a TTL and a size cap. The core does no I/O: the event feeds (ZMQ subscribers,
kv_events.KvFeeds) belong to the Router deployment and call `blocks_stored/removed/cleared`, the index
operations in our own hashes, which the trace simulation calls too.
"""

from __future__ import annotations

import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from serve_app.routing.index import EVENTS, PREDICTED, KvIndex
from serve_app.routing.policies import ReplicaLoad, prompt_tokens
from serve_app.routing.registry import make_policy
from serve_app.routing.throughput import FollowOnWork, OfferedWork, ReplicaRates, rates_for_new_replica, share_measurements
from serve_app.routing.ttft import DEFAULT_STEP_TOKENS, predict_ttft
from serve_app.routing.types import Decision, RouteRequest
from serve_app.settings import RouterConfig

log = logging.getLogger(__name__)

__all__ = ["Decision", "ReplicaLoad", "RouteRequest", "RouterCore"]


@dataclass(slots=True)
class _Reservation:
    # None once its replica is gone (`_forget`): the request may be starting again on a live replica, so the
    # reservation is kept, on no replica, for `redirect` to attach there; `release` or the TTL sweep ends it.
    replica_id: str | None
    prefill: int  # reserved uncached prompt tokens, 0 once prefilled
    decode: int
    at: float
    prompt: int = 0
    prefilled: bool = False
    predicted: float | None = None  # TTFT the router predicted at the decision (its error is measured)
    placed: int = 0  # the uncached prompt tokens the decision added to the replica's recent work
    # When `placed` was added there (the decision, or `redirect`): taking it back decays it from then, so nothing
    # is left over when a request moved before it was released unused.
    placed_at: float = 0.0
    moved: bool = False  # taken by another replica than the one chosen (`redirect`)
    # What `redirect` moves besides the load: the prompt's block hashes, the leading blocks the replica held at
    # the decision (a predicted index gained the rest), and the session the replica became the home of.
    hashes: list[int] | None = None
    held_blocks: int = 0
    session: str | None = None
    lost: str | None = None  # the replica it was on when that one was dropped


def _hold(load: ReplicaLoad, r: _Reservation, sign: int) -> None:
    """Add (`sign` 1) or remove (-1) a reservation's outstanding work on the replica it is on."""
    load.active_requests += sign
    load.active_prefill_tokens += sign * r.prefill
    load.active_decode_tokens += sign * r.decode


class RouterCore:
    def __init__(
        self,
        policy: str = "ttft",
        block_size: int = 16,
        config: RouterConfig | None = None,
        *,
        overlap_weight: float | None = None,
        decode_weight: float | None = None,
        prediction_ttl_s: float | None = None,
        prediction_max_blocks: int | None = None,
        reservation_ttl_s: float = 900.0,
        max_sessions: int = 100_000,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
    ):
        """`config`: the Serve config's router section; keyword arguments override it (simulation, tests)."""
        cfg = config if config is not None else RouterConfig()

        def pick(explicit, configured):
            return configured if explicit is None else explicit

        # The policies' own options (policies.KvConfig, ...): each policy takes those it declares.
        self._policy_options = {"overlap_weight": pick(overlap_weight, cfg.overlap_weight),
                                "decode_weight": decode_weight}
        self.policy = policy  # the name, as configured
        self._policy = make_policy(policy, **self._policy_options)
        self.block_size = block_size
        self.index = KvIndex(
            ttl_s=float(pick(prediction_ttl_s, cfg.prediction_ttl_s)),
            max_predicted_blocks=int(pick(prediction_max_blocks, cfg.prediction_max_blocks)),
        )
        self.loads: dict[str, ReplicaLoad] = {}
        self.rates: dict[str, ReplicaRates] = {}  # measured prefill/decode speed per replica (ttft policy)
        self.step_tokens = step_tokens  # the engines' prefill tokens per step, for the ttft prediction
        self.follow_on = FollowOnWork(clock())  # prefill a new session brings after its first request
        self.offered = OfferedWork(clock())  # prefill tokens per second routed to the fleet lately
        self.reservation_ttl_s = reservation_ttl_s
        self._inflight: OrderedDict[str, _Reservation] = OrderedDict()  # oldest first, for the TTL sweep
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._session_last: dict[str, tuple[str, list[int]]] = {}  # session -> its latest request id and blocks
        self._max_sessions = max_sessions
        self._clock = clock
        self.rng = random.Random(seed)
        self.decisions = 0
        self.prompt_tokens = 0
        self.cached_tokens_estimated = 0
        self.expired_reservations = 0
        self.reconciled_reservations = 0  # released because their replica no longer ran them (`reconcile`)
        self.redirected_reservations = 0  # moved to the replica that took the request instead (`redirect`)

    # ---- clock and session memory (read by policies) ----
    def now(self) -> float:
        return self._clock()

    def session_replica(self, key: str | None) -> str | None:
        if key is None:
            return None
        rid = self._sessions.get(key)
        return rid if rid in self.loads else None

    def session_inflight_blocks(self, key: str | None, rid: str, block_hashes: list[int]) -> int:
        """Leading blocks of `block_hashes` that the session's latest request, still in flight on `rid`, shares.

        The engine admits first come first served, so a request queued behind its session's previous one finds that
        one's prompt computed and cached by the time it is admitted, though no KV event has announced it yet.
        """
        last = self._session_last.get(key) if key is not None else None
        if last is None:
            return 0
        r = self._inflight.get(last[0])
        if r is None or r.replica_id != rid:
            return 0
        n = 0
        for mine, theirs in zip(block_hashes, last[1]):
            if mine != theirs:
                break
            n += 1
        return n

    # ---- replicas ----
    def sync_replicas(self, replica_ids: Iterable[str]) -> None:
        """Make the known replicas exactly `replica_ids` (a removed or dead replica disappears, index included)."""
        ids = list(replica_ids)
        live = set(ids)
        for rid in list(self.loads):
            if rid not in live:
                self._forget(rid)
        for rid in ids:
            self._ensure(rid)

    def _ensure(self, rid: str) -> None:
        if rid not in self.loads:
            self.loads[rid] = ReplicaLoad()
            self.rates[rid] = rates_for_new_replica(list(self.rates.values()), self.now())
            self.index.ensure(rid)

    def set_policy(self, policy: str) -> None:
        """Switch the policy at run time; the KV index, loads and in-flight requests are kept."""
        self._policy = make_policy(policy, **self._policy_options)
        self.policy = policy

    def _forget(self, rid: str) -> None:
        self.loads.pop(rid, None)
        self.rates.pop(rid, None)
        self.index.drop(rid)
        self._policy.forget(rid)
        for r in self._inflight.values():
            if r.replica_id == rid:
                r.replica_id, r.lost = None, rid

    def ensure_replica(self, replica_id: str) -> None:
        """Know `replica_id` (no-op if known): what a feed does before applying its first events."""
        self._ensure(replica_id)

    def register_replica(self, replica_id: str, block_size: int | None = None, *, events: bool = False) -> None:
        """A (re)starting engine replica: its index starts empty, kept from its KV events (`events`, fed by
        kv_events.KvFeeds) or predicted from this router's decisions."""
        if block_size and block_size != self.block_size:
            if any(len(rb) for rb in self.index.replicas.values()):
                log.warning("replica %s block size %s differs from the router's %s", replica_id, block_size,
                            self.block_size)
            else:
                self.block_size = block_size
        self._ensure(replica_id)
        self.index.replicas[replica_id].clear()  # a (re)registering engine starts from what its events say
        self.index.set_mode(replica_id, EVENTS if events else PREDICTED)

    def set_mode(self, replica_id: str, mode: str) -> None:
        if replica_id in self.loads:
            self.index.set_mode(replica_id, mode)

    # ---- index operations in our hashes (the event translator and the simulation call these) ----
    def blocks_stored(self, replica_id: str, hashes: Iterable[int]) -> None:
        rb = self.index.replicas.get(replica_id)
        if rb is not None:
            rb.add(hashes, self.now())

    def blocks_removed(self, replica_id: str, hashes: Iterable[int]) -> None:
        rb = self.index.replicas.get(replica_id)
        if rb is not None:
            rb.remove(hashes)

    def blocks_cleared(self, replica_id: str) -> None:
        rb = self.index.replicas.get(replica_id)
        if rb is not None:
            rb.clear()

    # ---- decisions ----
    def choose(self, req: RouteRequest, candidates: list[str] | None = None) -> Decision:
        cands = list(self.loads) if candidates is None else list(candidates)
        if not cands:
            raise ValueError("no candidate replicas")
        for rid in cands:
            self._ensure(rid)
        now = self.now()
        self._expire_reservations(now)
        rid, cached_blocks = self._policy.choose(self, req, cands)
        n = prompt_tokens(req, self.block_size)
        cached = min(cached_blocks * self.block_size, n)
        if req.session_key is not None:
            if req.session_key in self._sessions:
                self.follow_on.later_turn(now, n - cached)
            else:
                self.follow_on.new_session(now)
        # What this request's TTFT should be there, before it joins the queue: the report measures the error.
        predicted = predict_ttft(self, rid, n - cached, self.step_tokens)
        self._reserve(req, rid, n - cached, now)
        r = self._inflight[req.request_id]
        r.predicted, r.hashes, r.held_blocks, r.session = predicted, req.block_hashes, cached_blocks, req.session_key
        if self.index.replicas[rid].mode == PREDICTED and req.block_hashes:
            self.index.replicas[rid].add(req.block_hashes, now)
        if req.session_key is not None:
            self._remember_session(req.session_key, rid)
            self._session_last[req.session_key] = (req.request_id, req.block_hashes)
        self._policy.on_routed(self, req, rid)
        self.decisions += 1
        self.prompt_tokens += n
        self.cached_tokens_estimated += cached
        return Decision(replica_id=rid, policy=self.policy, cached_blocks=cached_blocks)

    def _remember_session(self, key: str, rid: str) -> None:
        self._sessions[key] = rid
        self._sessions.move_to_end(key)
        if len(self._sessions) > self._max_sessions:
            old, _ = self._sessions.popitem(last=False)
            self._session_last.pop(old, None)

    def _reserve(self, req: RouteRequest, rid: str, prefill_tokens: int, now: float) -> None:
        if req.request_id in self._inflight:  # a retried id: its old reservation is superseded
            self.release(req.request_id, measured=False)
        r = self._inflight[req.request_id] = _Reservation(rid, prefill_tokens, req.expected_output_tokens, now,
                                                          prompt_tokens(req, self.block_size), placed=prefill_tokens,
                                                          placed_at=now)
        load = self.loads[rid]
        _hold(load, r, 1)
        load.routed += 1
        load.add_recent(prefill_tokens, now)
        self.rates[rid].started(now, prefill_tokens)
        self.offered.add(now, prefill_tokens)

    def mark_prefilled(self, request_id: str, cached_tokens: int | None = None, *, measured: bool = True) -> None:
        """The request's first token came back: its prefill no longer loads the replica.

        `cached_tokens` is what the engine reports it reused (vLLM's num_cached_tokens); with it the replica's
        prefill rate is measured on the tokens really computed, without it on the router's own estimate.
        `measured=False`: learnt late (`reconcile`), so the time since the decision is not the prefill's.
        """
        r = self._inflight.get(request_id)
        if r is None or r.prefilled:
            return
        load = self.loads.get(r.replica_id)
        if load is not None:
            load.active_prefill_tokens -= r.prefill
            if measured:
                done = r.prefill if cached_tokens is None else max(0, r.prompt - cached_tokens)
                now = self.now()
                rates = self.rates[r.replica_id]
                first = not rates.prefill.samples
                rates.prefilled(now, done, r.prefill, now - r.at, r.predicted)
                if first and rates.prefill.samples:
                    share_measurements(list(self.rates.values()))
        r.prefill = 0
        r.prefilled = True

    def reconcile(self, replica_id: str, running: dict[str, bool], *, older_than: float,
                  owned: Callable[[str], bool] = lambda request_id: True) -> int:
        """What `replica_id` says it is running now (request id -> prefilled), for the reports that never came:
        each reservation on it made before `older_than` (the router's clock) that it does not list has ended,
        and each it lists as prefilled no longer loads its prefill. Neither is a measurement. Only reservations
        `owned` says are this router's are touched. Returns how many were released."""
        gone, prefilled = [], []
        for request_id, r in self._inflight.items():  # oldest first
            if r.at >= older_than:
                break
            if r.replica_id != replica_id or not owned(request_id):
                continue
            if request_id not in running:
                gone.append(request_id)
            elif running[request_id] and not r.prefilled:
                prefilled.append(request_id)
        for request_id in prefilled:
            self.mark_prefilled(request_id, measured=False)
        for request_id in gone:
            self.release(request_id, measured=False)
        self.reconciled_reservations += len(gone)
        return len(gone)

    def redirect(self, request_id: str, replica_id: str, *, restart: bool = False) -> bool:
        """The request was taken by `replica_id`, not the replica it was reserved on: Serve's handle did not list
        the chosen one yet, or had just dropped it, or that replica died and the request is handed over
        (`restart`: it starts again from its beginning, even if it was prefilled where it was). Its reservation,
        its placement work, its later reports, its blocks in a predicted index and its session's home move
        there, before its prefill; its prefill there is estimated from the taker's index. A reservation whose
        replica is gone (`_forget`) attaches here. Returns whether it moved."""
        r = self._inflight.get(request_id)
        new = self.loads.get(replica_id)
        if r is None or new is None or r.replica_id == replica_id or (r.prefilled and not restart):
            return False
        now = self.now()
        old = self.loads.get(r.replica_id)  # None also for a reservation whose replica is gone
        if old is not None:
            _hold(old, r, -1)
            self.rates[r.replica_id].finished(now, None, r.prefilled, r.prefill)  # not a measurement there
            if not restart:  # never prefilled there: its placement work and its count go with it
                old.take_back_recent(r.placed, r.placed_at, now)
                old.routed -= 1
        held_before, held = r.held_blocks, 0
        if r.hashes:
            held = self.index.overlaps(r.hashes, [replica_id], now)[replica_id]
        r.prefill = r.placed = max(0, r.prompt - held * self.block_size)
        r.prefilled, r.held_blocks = False, held
        if restart or old is None:
            # Its prefill starts now, so the taker's prefill rate is measured from here, not from the decision.
            r.at = now
            self._inflight.move_to_end(request_id)  # the sweeps read the reservations oldest first
        new.add_recent(r.placed, now)
        r.placed_at = now
        new.routed += 1
        _hold(new, r, 1)
        self.rates[replica_id].started(now, r.prefill)
        self._move_footprint(r, replica_id, held_before, restart, now)
        r.replica_id, r.lost, r.predicted, r.moved = replica_id, None, None, True  # predicted for the other
        self.redirected_reservations += 1
        return True

    def _move_footprint(self, r: _Reservation, replica_id: str, held_before: int, restart: bool, now: float) -> None:
        """Where the index is predicted from decisions, the prompt's blocks are the taker's now, not the chosen's
        (those it held before the decision stay, and a replica the request ran on keeps them); and the session's
        home is where its prefix went."""
        if r.hashes:
            was = self.index.replicas.get(r.replica_id)
            if was is not None and was.mode == PREDICTED and not restart:
                was.remove(r.hashes[held_before:])
            if self.index.replicas[replica_id].mode == PREDICTED:
                self.index.replicas[replica_id].add(r.hashes, now)
            self._policy.on_moved(self, r.hashes, replica_id)
        home = r.replica_id if r.replica_id is not None else r.lost
        if r.session is not None and self._sessions.get(r.session) == home:
            self._sessions[r.session] = replica_id

    def redirected(self, request_id: str) -> bool:
        """Whether `request_id`'s reservation was moved by `redirect`."""
        r = self._inflight.get(request_id)
        return r is not None and r.moved

    def release(self, request_id: str, output_tokens: int | None = None, *, measured: bool = True,
                unused: bool = False) -> bool:
        """The request is over (finished, failed or cancelled); `output_tokens` is how many it generated.
        `unused`: the decision was never carried out (the request never reached an engine, or went elsewhere
        and nothing will report it), so the replica did not take on its cache footprint either: the work the
        decision added to the placement memory (`ReplicaLoad.recent`) is taken back. Otherwise one undelivered
        answer would steer new sessions away from the replica for hours. Returns whether a reservation was held
        for it."""
        r = self._inflight.pop(request_id, None)
        if r is None:
            return False
        load = self.loads.get(r.replica_id)
        if load is not None and unused:
            load.take_back_recent(r.placed, r.placed_at, self.now())
            load.routed -= 1
        if load is not None:
            _hold(load, r, -1)
            # An expired or superseded reservation's duration is not a measurement of the replica.
            tokens = (r.decode if output_tokens is None else output_tokens) if measured else None
            rates = self.rates[r.replica_id]
            first = not rates.decode.samples
            rates.finished(self.now(), tokens, r.prefilled, r.prefill)
            if first and rates.decode.samples:
                share_measurements(list(self.rates.values()))
        return True

    def _expire_reservations(self, now: float) -> None:
        # A caller that died never releases; its reservation must not weigh on the replica forever.
        cutoff = now - self.reservation_ttl_s
        while self._inflight:
            req_id, r = next(iter(self._inflight.items()))
            if r.at > cutoff:
                break
            self.release(req_id, measured=False)
            self.expired_reservations += 1

    # ---- metrics ----
    def metrics(self, per_replica: dict[str, dict] | None = None) -> dict:
        """The router's state; `per_replica` adds fields to each replica's entry (its event feed's stats)."""
        per_replica = per_replica or {}
        orphaned = sum(1 for r in self._inflight.values() if r.replica_id is None)
        replicas = {}
        for rid, load in self.loads.items():
            rb = self.index.replicas.get(rid)
            replicas[rid] = {
                "mode": rb.mode if rb is not None else PREDICTED,
                "blocks": len(rb) if rb is not None else 0,
                "active_requests": load.active_requests,
                "routed": load.routed,
                "active_prefill_tokens": load.active_prefill_tokens,
                "active_decode_tokens": load.active_decode_tokens,
                **(self.rates[rid].stats() if rid in self.rates else {}),
                **per_replica.get(rid, {}),
            }
        return {
            "policy": self.policy,
            "block_size": self.block_size,
            "replicas": replicas,
            "inflight": len(self._inflight) - orphaned,
            "orphaned_reservations": orphaned,  # their replica is gone; a handover may attach them (`redirect`)
            "decisions": self.decisions,
            "estimated_hit_rate": self.cached_tokens_estimated / self.prompt_tokens if self.prompt_tokens else 0.0,
            "expired_reservations": self.expired_reservations,
            "reconciled_reservations": self.reconciled_reservations,
            "redirected_reservations": self.redirected_reservations,
        }
