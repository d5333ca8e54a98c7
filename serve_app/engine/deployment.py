"""The Engine deployment: one vLLM engine per replica. Thin: the logic is in vllm_engine.py."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from ray import serve

from serve_app.engine.delta_channel import DeltaSender
from serve_app.engine.provision import ensure_model
from serve_app.engine.registration import register_forever, registration
from serve_app.engine.types import EngineChunk, EngineRequest
from serve_app.engine.vllm_engine import VLLMEngine
from serve_app.serve_tuning import freeze_startup_heap
from serve_app.settings import ModelConfig

log = logging.getLogger(__name__)


# Above vLLM's own max_num_seqs (128-256 on CPU, more on GPUs): the engine's scheduler queues and prioritises,
# not Serve.
@serve.deployment(name="Engine", max_ongoing_requests=256, health_check_period_s=10)
class Engine:
    def __init__(self, model: dict, *, engine_key: str, forced_scripts: bool, kv_events: bool, model_cache_dir, router=None):
        cfg = ModelConfig.model_validate(model)
        path = ensure_model(cfg.model_source, model_cache_dir)
        # vLLM's engine metrics (queue, KV usage, prefix-cache hits, its own TTFT) go through Ray's metrics like
        # the service's, tagged with this replica's id: its default Prometheus logger would fill a registry in
        # this process that nothing serves.
        # (engine/stat_logger.py: all of vLLM's metrics but the one recorded per generated token)
        from serve_app.engine.stat_logger import EngineStatLogger

        self.engine = VLLMEngine(cfg, path, forced_scripts=forced_scripts, kv_events=kv_events,
                                 stat_loggers=[EngineStatLogger])
        self.engine.start()
        self.engine_key = engine_key
        self._deltas = DeltaSender()
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self._router = router
        self._register_task = asyncio.get_event_loop().create_task(self._register()) if router is not None else None
        freeze_startup_heap()

    async def _register(self) -> None:
        import ray

        reg = registration(self.engine_key, self.replica_id, self.engine, ray.util.get_node_ip_address())
        await register_forever(self._router, reg)

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        self.engine.validate(req)
        # Acceptance: this replica took the request (see clients.open).
        yield EngineChunk(text="", token_ids=[], replica=self.replica_id)
        if req.reply_to is None:
            async for chunk in self.engine.generate(req):
                yield chunk
            return
        # The call is the request's lease; its deltas go over the delta channel, batched per engine step.
        address, key = req.reply_to
        self._deltas.acquire(address)
        try:
            async for chunk in self.engine.generate(req):
                self._deltas.send(address, key, chunk)
        finally:
            self._deltas.release(address)

    async def info(self) -> dict:
        return {"replica_id": self.replica_id, "block_size": self.engine.block_size,
                "max_model_len": self.engine.max_model_len, "reasoning_gate": self.engine.reasoning_gate}

    async def num_unfinished(self) -> int:
        return await self.engine.num_unfinished()

    async def check_health(self) -> None:
        await self.engine.check_health()

    def __del__(self):
        try:
            self._deltas.close()
            self.engine.shutdown()
        except Exception:
            pass
