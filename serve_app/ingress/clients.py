"""The ingress's way to the Router and Engine deployments (the Ray side of service.EngineClient)."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from serve_app import metrics
from serve_app.engine.types import EngineChunk, EngineRequest, merge_chunks
from serve_app.routing.types import Decision, RouteRequest
from serve_app.streams import Pump

log = logging.getLogger(__name__)


class ServeEngineClient:
    def __init__(self, engines: dict, router, router_timeout_s: float = 0.5):
        # Calls go over Serve's gRPC transport (`_by_reference=False`) rather than as Ray actor calls and object
        # refs: a streamed token costs a fraction of the CPU (docs/serving-path.md), and the replicas' results
        # are never passed on by reference anyway.
        self._engines = {key: h.options(_by_reference=False) for key, h in engines.items()}  # key -> handle
        self._router = router.options(_by_reference=False) if router is not None else None
        self._router_timeout_s = router_timeout_s
        self._block_sizes: dict[str, int] = {}

    async def block_size(self, engine_key: str) -> int:
        size = self._block_sizes.get(engine_key)
        if size is None:
            info = await self._engines[engine_key].info.remote()
            size = self._block_sizes[engine_key] = int(info["block_size"])
        return size

    async def probe(self, engine_key: str) -> None:
        await self._engines[engine_key].info.remote()

    async def choose(self, engine_key: str, req: RouteRequest) -> Decision | None:
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
        if decision is not None:
            metrics.observe_router_decision(decision.policy, "cache_hit" if decision.cached_blocks else "cache_miss")
        return decision

    def prefilled(self, engine_key: str, request_id: str, cached_tokens: int | None = None) -> None:
        if self._router is not None:
            try:
                self._router.mark_prefilled.remote(engine_key, request_id, cached_tokens)  # fire and forget
            except Exception:  # noqa: BLE001
                pass

    def release(self, engine_key: str, request_id: str, output_tokens: int | None = None) -> None:
        if self._router is not None:
            try:
                self._router.release.remote(engine_key, request_id, output_tokens)
            except Exception:  # noqa: BLE001
                pass

    async def open(self, engine_key: str, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Start the call and return its chunks once a replica has taken it. The Engine deployment's first
        chunk is an empty acceptance, so a full engine queue (Serve's BackPressureError) is raised here, before
        the ingress has committed a response head, and becomes a plain 429/529."""
        gen = self._engines[engine_key].options(stream=True).generate.remote(req)
        try:
            await gen.__anext__()  # the acceptance chunk
        except BaseException:
            gen.cancel()
            raise
        return self._rest(gen)

    @staticmethod
    async def _rest(gen) -> AsyncIterator[EngineChunk]:
        """The chunks after the acceptance. Read ahead (serve_app/streams.py): when the consumer (parse, encode,
        send) falls behind, the chunks that arrived meanwhile are merged into one, so its per-chunk work is
        paid once per batch; when it keeps up nothing waits."""
        pump = Pump(gen)
        finished = False
        try:
            while True:
                try:
                    batch = await pump.next_batch()
                except StopAsyncIteration:
                    return
                chunk = merge_chunks(batch)
                yield chunk
                if chunk.finish_reason is not None:
                    finished = True
                    return
        finally:
            await pump.aclose()
            if not finished:
                # The client went away (or we stopped early): cancelling the Serve call cancels the replica's
                # generator, and AsyncLLM aborts the request and frees its KV blocks.
                gen.cancel()
