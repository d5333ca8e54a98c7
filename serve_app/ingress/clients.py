"""The ingress's way to the Router and Engine deployments (the Ray side of service.EngineClient)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

from serve_app import metrics
from serve_app.engine.delta_channel import DeltaReceiver, Inbox
from serve_app.engine.types import EngineChunk, EngineRequest, merge_chunks
from serve_app.errors import replica_gone
from serve_app.routing.types import Decision, RouteRequest

if TYPE_CHECKING:
    from serve_app.routing.local import LocalRouter

log = logging.getLogger(__name__)

_GONE_RETRIES = 2  # restarts of a request whose replica died after accepting it, before its first delta
# A request whose replica is gone before it accepted is sent again for this long: Serve may pick the dead replica
# until its request router has taken the failed call's report (serve_router.py then passes it over) or its
# controller has dropped it, which follows Ray declaring the node dead (about 4 s here). Two quick retries were
# not always enough (test_node_loss: a 500 half a second after the loss).
GONE_RETRY_S = 5.0
# Before each such retry, doubling up to _GONE_BACKOFF_MAX_S: lets the failed call's report land first.
_GONE_BACKOFF_S = 0.05
_GONE_BACKOFF_MAX_S = 0.5
# How long a request whose replica died before its first delta may wait for another replica to accept it. A live
# replica accepts at once; with none (the only replica died) Serve would hold the call until a replacement has
# started, minutes for a vLLM engine, while the client waits on an open stream: past this the request fails.
FAILOVER_ACCEPT_S = 10.0


class ServeEngineClient:
    def __init__(self, engines: dict, router, router_timeout_s: float = 0.5, local: LocalRouter | None = None,
                 gone_retry_s: float = GONE_RETRY_S):
        """`local`: this ingress's own routing table (`router.placement: ingress`); without it every decision is
        a call to the Router deployment `router`."""
        self._gone_retry_s = gone_retry_s
        # Calls go over Serve's gRPC transport (`_by_reference=False`) rather than as Ray actor calls and object
        # refs: a streamed token costs a fraction of the CPU (docs/serving-path.md), and the replicas' results
        # are never passed on by reference anyway.
        self._engines = {key: h.options(_by_reference=False) for key, h in engines.items()}  # key -> handle
        self._router = router.options(_by_reference=False) if router is not None else None
        self._router_timeout_s = router_timeout_s
        self.local = local
        self._infos: dict[str, dict] = {}  # engine key -> its `info()`: fixed for the engine's life
        self._receiver: DeltaReceiver | None = None
        self._leases: set[asyncio.Task] = set()

    async def _info(self, engine_key: str) -> dict:
        info = self._infos.get(engine_key)
        if info is None:
            info = self._infos[engine_key] = await self._engines[engine_key].info.remote()
        return info

    async def block_size(self, engine_key: str) -> int:
        return int((await self._info(engine_key))["block_size"])

    async def reasoning_gate(self, engine_key: str) -> bool:
        return bool((await self._info(engine_key)).get("reasoning_gate"))

    async def probe(self, engine_key: str) -> None:
        # vLLM's own health check (raises once its engine core has died), not just "the replica's actor answers".
        await self._engines[engine_key].check_health.remote()

    async def choose(self, engine_key: str, req: RouteRequest) -> Decision | None:
        if self.local is not None:
            await self.local.ready(self._router_timeout_s)
            decision = self.local.choose(engine_key, req)
            if decision is None:
                metrics.observe_router_decision("fallback", "no_replicas_known")
            return _observed(decision)
        if self._router is None:
            return None
        try:
            decision = await asyncio.wait_for(self._router.choose.remote(engine_key, req), self._router_timeout_s)
        except Exception as e:  # noqa: BLE001 - an unavailable Router must not fail requests
            log.warning("router unavailable (%s); routing least-loaded", type(e).__name__)
            metrics.observe_router_decision("fallback", "router_unavailable")
            # A slow Router may still make the decision and reserve load for it: free that reservation, since
            # this request will not report back under it.
            self.release(engine_key, req.request_id)
            return None
        return _observed(decision)

    def prefilled(self, engine_key: str, request_id: str, cached_tokens: int | None = None) -> None:
        self._report("mark_prefilled", engine_key, request_id, cached_tokens)

    def redirect(self, engine_key: str, request_id: str, replica_id: str, restart: bool = False) -> None:
        self._report("redirect", engine_key, request_id, replica_id, restart)

    def release(self, engine_key: str, request_id: str, output_tokens: int | None = None) -> None:
        self._report("release", engine_key, request_id, output_tokens)

    def _report(self, method: str, *args: Any) -> None:
        """Tell the routing table about a request: this ingress's own, or the Router's (fire and forget: a report
        that cannot be sent must not fail the request; the Router's reservations expire)."""
        if self.local is not None:
            getattr(self.local, method)(*args)
        elif self._router is not None:
            try:
                getattr(self._router, method).remote(*args)
            except Exception:  # noqa: BLE001
                pass

    def _deltas(self) -> DeltaReceiver:
        if self._receiver is None:
            import ray

            self._receiver = DeltaReceiver(ray.util.get_node_ip_address())
        return self._receiver

    async def open(self, engine_key: str, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Start the call and return its chunks once a replica has taken it. The Engine deployment's first
        chunk is an empty acceptance, so a full engine queue (Serve's BackPressureError) is raised here, before
        the ingress has committed a response head, and becomes a plain 429/529.

        The call then stays open as the request's lease while its deltas arrive over the delta channel
        (engine/delta_channel.py): one frame per engine step for all of this process's requests on a replica.
        A replica that dies after taking the request but before its first delta (a node lost mid-admission) has
        shown the client nothing: the request starts again on a live replica instead of failing."""
        return self._failover(engine_key, req, await self._open(engine_key, req))

    async def _failover(self, engine_key: str, req: EngineRequest, stream: AsyncIterator[EngineChunk]
                        ) -> AsyncIterator[EngineChunk]:
        restarts = 0
        try:
            while True:
                started = False
                try:
                    async for chunk in stream:
                        started = True
                        yield chunk
                    return
                except Exception as e:
                    if started or not replica_gone(e) or restarts == _GONE_RETRIES:
                        raise
                    log.warning("replica died before request %s's first token (%s); starting it on a live one",
                                req.request_id, type(e).__name__)
                    gone = e
                restarts += 1
                await stream.aclose()
                stream = await self._handover(engine_key, req, gone)
        finally:
            await stream.aclose()

    async def reopen(self, engine_key: str, req: EngineRequest, lost: Exception) -> AsyncIterator[EngineChunk]:
        """Start `req` again from its beginning after its replica was lost (`lost`) midway through its answer, which
        its caller showed nobody (service.complete): on a live replica, with the same bounds as a restart before
        the first delta; raises `lost` when none takes it."""
        return self._failover(engine_key, req, await self._handover(engine_key, req, lost))

    async def _handover(self, engine_key: str, req: EngineRequest, gone: Exception) -> AsyncIterator[EngineChunk]:
        """`req`'s replica is gone (`gone`): open it on a live one if one is known and accepts within
        FAILOVER_ACCEPT_S, else raise `gone` (the only replica died: fail now rather than hold the client while
        Serve starts a replacement)."""
        self._forget(engine_key, req)
        if not self._live_known(engine_key):
            raise gone
        try:
            return await asyncio.wait_for(self._open(engine_key, req, restart=True), FAILOVER_ACCEPT_S)
        except asyncio.TimeoutError:
            raise gone from None

    def _live_known(self, engine_key: str) -> bool:
        """Whether a replica is still known to be live (the local table's view; without one, assume so and let
        the bounded wait decide)."""
        return self.local is None or self.local.knows_live(engine_key)

    def _forget(self, engine_key: str, req: EngineRequest) -> None:
        """The request's replica is gone: route away from it (the local table now; Serve's request router has
        dropped it on the failed call and reports that to the Router, serve_router.py)."""
        if self.local is not None and req.target_replica is not None:
            self.local.drop_replica(engine_key, req.target_replica)
        req.target_replica = None

    async def _open(self, engine_key: str, req: EngineRequest, restart: bool = False) -> AsyncIterator[EngineChunk]:
        """`restart`: the request starts again from its beginning (its replica was lost)."""
        receiver = self._deltas()
        key, inbox = receiver.register()
        req.reply_to = (receiver.address, key)
        try:
            deadline = time.monotonic() + self._gone_retry_s
            for attempt in itertools.count():
                try:
                    gen = await self._accepted(engine_key, req, restart)
                    break
                except Exception as e:
                    if not replica_gone(e) or time.monotonic() >= deadline:
                        raise
                    # The replica (the Router's choice, or Serve's own before it noticed) died before it accepted
                    # (a node lost): nothing ran yet, so send the request to whichever live replica Serve picks.
                    # The call that failed has already made Serve drop the replica and report that to the Router
                    # (serve_router.py).
                    log.warning("replica %s is gone (%s); routing request %s to a live one", req.target_replica,
                                type(e).__name__, req.request_id)
                    self._forget(engine_key, req)
                    await asyncio.sleep(min(_GONE_BACKOFF_S * 2 ** attempt, _GONE_BACKOFF_MAX_S))
        except BaseException:
            receiver.unregister(key)
            raise
        lease = asyncio.get_running_loop().create_task(_watch_lease(gen, inbox))
        self._leases.add(lease)
        lease.add_done_callback(self._leases.discard)
        return self._rest(gen, lease, receiver, key, inbox)

    async def _accepted(self, engine_key: str, req: EngineRequest, restart: bool = False):
        gen = self._engines[engine_key].options(stream=True).generate.remote(req)
        try:
            accepted = await gen.__anext__()  # the acceptance chunk
        except BaseException:
            gen.cancel()
            raise
        if accepted.replica is not None:
            if req.reserved_on is not None and accepted.replica != req.reserved_on:
                # Serve's request router sent it elsewhere (its replica set lags the Router's, or the target had
                # just gone), or it was handed over from a lost replica: its reservation, and the reports that
                # follow, belong to the replica that took it.
                self.redirect(engine_key, req.request_id, accepted.replica, restart)
                req.reserved_on = accepted.replica
            # Where it runs: a replica lost under it is dropped by this id (`_forget`), and the next turn's warm-up
            # goes where its prefix is.
            req.target_replica = accepted.replica
        return gen

    @staticmethod
    async def _rest(gen, lease: asyncio.Task, receiver: DeltaReceiver, key: int, inbox: Inbox
                    ) -> AsyncIterator[EngineChunk]:
        """The chunks after the acceptance. Whatever arrived while the consumer (parse, encode, send) was busy
        comes merged into one chunk, so its per-chunk work is paid once per batch; when it keeps up nothing waits."""
        finished = False
        try:
            while True:
                chunk = merge_chunks(await inbox.next())
                yield chunk
                if chunk.finish_reason is not None:
                    finished = True
                    return
        finally:
            receiver.unregister(key)
            if not finished:
                # The client went away (or the stream broke): cancelling the Serve call cancels the replica's
                # generator, and AsyncLLM aborts the request and frees its KV blocks.
                gen.cancel()
                lease.cancel()


def _observed(decision: Decision | None) -> Decision | None:
    if decision is not None:
        metrics.observe_router_decision(decision.policy, decision.outcome)
    return decision


async def _watch_lease(gen, inbox: Inbox) -> None:
    """Follow the request's Serve call: its failure (replica died, engine error) fails the inbox; its normal end
    starts the wait for a last delta still on its way."""
    try:
        async for _ in gen:
            pass
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - handed to the consumer after the deltas before it
        inbox.fail(e)
    else:
        inbox.lease_ended()
