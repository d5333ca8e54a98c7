"""The Engine deployment: one vLLM engine per replica. Thin: the logic is in vllm_engine.py."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from ray import serve

from serve_app.engine.delta_channel import DeltaSender
from serve_app.engine.provision import ensure_model
from serve_app.engine.types import EngineChunk, EngineRequest
from serve_app.engine.vllm_engine import VLLMEngine
from serve_app.serve_tuning import freeze_startup_heap
from serve_app.settings import ModelConfig

log = logging.getLogger(__name__)

REREGISTER_S = 30.0  # how soon a restarted Router relearns this replica's KV event endpoints


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
        """Tell the Router where this replica publishes KV events: retried until it answers (the Router may start
        later), then repeated every REREGISTER_S so that a Router replica that restarted (and lost its table)
        learns this replica again; a repeat of a registration the Router holds changes nothing there."""
        import ray

        host = ray.util.get_node_ip_address()
        e = self.engine
        registration = (
            self.engine_key,
            self.replica_id,
            f"tcp://{host}:{e.kv_events_port}" if e.kv_events_port else None,
            f"tcp://{host}:{e.kv_replay_port}" if e.kv_replay_port else None,
            e.block_size,
        )
        attempt = 0
        registered = False
        while True:
            try:
                await self._router.register_replica.remote(*registration, refresh=registered)
                registered, attempt = True, 0
                await asyncio.sleep(REREGISTER_S)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep serving; routing falls back to load only
                attempt += 1
                if attempt == 1 or attempt % 30 == 0:
                    log.info("router registration attempt %d failed: %s", attempt, exc)
                await asyncio.sleep(min(2.0, 0.2 * attempt))

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        self.engine.validate(req)
        yield EngineChunk(text="", token_ids=[])  # acceptance: this replica took the request (see clients.open)
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
