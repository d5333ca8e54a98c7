"""The engines in the ingress's own process (`engine_placement: ingress`): service.EngineClient without Ray.

Each engine is a VLLMEngine (an AsyncLLM whose engine core runs in a child process, as under vLLM's own API
server), so a token's path is engine core → this process, where it is parsed and framed: no Serve call per
request and no relay process per token (docs/serving-path.md, "The engines in the ingress"). There is no routing
choice to make: this process's engine is the one that serves. What the Engine deployment's Serve call gave the
other placement comes from AsyncLLM itself here: a consumer that falls behind gets the deltas that piled up as one
(vLLM's per-request output collector merges `DELTA` outputs), and closing the stream aborts the request in the
engine, which frees its KV blocks (VLLMEngine.generate).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator, Callable

from serve_app import metrics
from serve_app.engine.registration import register_forever, registration
from serve_app.engine.types import EngineChunk, EngineRequest
from serve_app.errors import ServiceError
from serve_app.routing.types import Decision, RouteRequest
from serve_app.settings import EngineRestarts, ModelConfig

log = logging.getLogger(__name__)

REPORT_TIMEOUT_S = 10.0
# With several front-door Router replicas (one per proxy node) each call reaches one of them: repeating the
# registration often lets every replica learn it within a few periods (a repeat it holds changes nothing).
REGISTER_EVERY_S = 5.0


async def _settle(response) -> None:
    try:
        await asyncio.wait_for(response, REPORT_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - the Router's reservation then expires on its own
        log.debug("routing report not delivered: %s", e)

POLICY = "in-process"  # the request log's `route` for a request this process's own engine served
RESTARTING_RETRY_AFTER_S = 5.0


class EngineRestarting(ServiceError):
    """A request for an engine being replaced after its engine core died: 503 (Anthropic's 529) with Retry-After,
    which the harnesses retry."""

    def __init__(self, engine_key: str):
        super().__init__("overloaded", f"the model's engine ({engine_key}) failed and is restarting; retry shortly",
                         code="engine_restarting", retry_after=RESTARTING_RETRY_AFTER_S)


class LocalEngineClient:
    def __init__(self, engines: dict, replica_id: str = "local",
                 restart: Callable[[str, object], object] | None = None,
                 restarts: EngineRestarts | None = None):
        """`engines`: engine key -> a started VLLMEngine (or anything with its interface). `restart(key, dead)`:
        stops a dead engine and returns a started replacement (blocking; run in a worker thread); None: a dead
        engine stays dead and fails the health check, for Serve (or the single process's supervisor) to replace
        the whole process. `restarts`: how many replacements per engine within a window before that."""
        self._engines = engines
        self.replica_id = replica_id
        self._restart = restart
        self._restarts = restarts or EngineRestarts()
        self._restarted_at: dict[str, list[float]] = {key: [] for key in engines}
        self._restarting: dict[str, asyncio.Task] = {}
        self._restart_failed: dict[str, BaseException] = {}
        self._given_up: set[str] = set()
        # Held by the thread starting a replacement: one engine start at a time (they set this process's
        # environment for their engine core), and `shutdown` waits for a start under way instead of leaving the new
        # engine's processes behind.
        self._starting = threading.Lock()
        self._closing = False
        self._registering: dict[str, asyncio.Task] = {}
        # With the front door's routing (`router.front_door`): the Router that chose this replica, told of each
        # request's prefill and end as the Engine deployment's ingress tells it (routing/front_door_deployment.py).
        self._router = None
        self._reports: set = set()
        self._tasks: set = set()
        # engine key -> the front door's route ids running here -> prefilled yet: sent with each registration, so
        # a Router replica whose reports went to another replica (several proxy nodes) still learns the end.
        self._running: dict[str, dict[str, bool]] = {key: {} for key in engines}
        # Route ids a request here took to an engine (its stream then reports its end) and whose HTTP request has
        # not ended yet (`settle`).
        self._claimed: set[str] = set()

    def report_to(self, router, host: str) -> None:
        """For the front door's Router (routing/front_door_deployment.py): register every engine here with it
        (their KV event endpoints on `host`), repeated every REGISTER_EVERY_S while this process lives, and report
        each request it placed here when it prefilled and when it ended. Needs the running event loop."""
        self._router = router
        self._router_host = host
        for key in self._engines:
            self._register(key)

    def _register(self, key: str) -> None:
        """(Re)start `key`'s registration with the front door's Router, for the engine now under that key (a
        replacement publishes its KV events on ports of its own)."""
        if self._router is None:
            return
        if (old := self._registering.pop(key, None)) is not None:
            old.cancel()
        reg = registration(key, self.replica_id, self._engines[key], self._router_host)
        running = self._running[key]
        task = asyncio.get_running_loop().create_task(register_forever(
            self._router, reg, REGISTER_EVERY_S, extra=lambda running=running: {"running": dict(running)}))
        self._registering[key] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @classmethod
    def start(cls, models: list[ModelConfig], *, forced_scripts: bool, model_cache_dir: str | None,
              replica_id: str = "local", stat_loggers: list | None = None,
              kv_events: bool = False, restarts: EngineRestarts | None = None) -> "LocalEngineClient":
        """One VLLMEngine per engine key of `models` (models that share weights and engine settings share one),
        started in this process, those with the same environment at the same time (`start_engines`). `kv_events`:
        publish each engine's KV events (for a Router that routes to this process, `report_to`). A dead engine is
        replaced in place, up to `restarts`."""
        from serve_app.engine.provision import ensure_model
        from serve_app.engine.vllm_engine import VLLMEngine, freeze_vllm_envs, start_engines, thaw_vllm_envs
        from serve_app.service import engine_key

        def make(m: ModelConfig):
            return VLLMEngine(m, ensure_model(m.model_source, model_cache_dir), forced_scripts=forced_scripts,
                              kv_events=kv_events, stat_loggers=stat_loggers)

        engines: dict = {}
        configs: dict[str, ModelConfig] = {}
        for m in models:
            key = engine_key(m)
            if key not in engines:
                engines[key], configs[key] = make(m), m
        start_engines(list(engines.values()))
        freeze_vllm_envs()

        def restart(key: str, dead) -> object:
            try:
                dead.shutdown()
            except Exception:  # noqa: BLE001 - what is left of it must not keep the replacement from starting
                log.exception("engine %s: stopping the dead engine failed", key)
            engine = make(configs[key])
            # Its engine core reads its settings from this process's environment, as at start-up: vLLM's cached
            # reads are thawed for the start and frozen again after it (`_starting` keeps starts one at a time).
            thaw_vllm_envs()
            try:
                engine.start(cache_envs=False)
            finally:
                freeze_vllm_envs()
            return engine

        return cls(engines, replica_id, restart=restart, restarts=restarts)

    def _engine(self, engine_key: str):
        """The engine serving `engine_key`; EngineRestarting while it is being replaced (a dead one found here
        starts its replacement at once, without waiting for the next health check)."""
        try:
            engine = self._engines[engine_key]
        except KeyError:
            raise RuntimeError(f"no engine {engine_key} in this process") from None
        if engine_key in self._restarting or (engine.dead and self._begin_restart(engine_key, "found dead")):
            raise EngineRestarting(engine_key)
        return engine

    # -- replacing a dead engine --------------------------------------------------------------------------------

    def _begin_restart(self, key: str, why: object) -> bool:
        """Start replacing `key`'s dead engine, unless it has used up its restarts (or this client has no way to
        restart): False then, and the process's health check fails for its supervisor to replace it."""
        if key in self._restarting:
            return True
        if self._restart is None or self._closing or key in self._restart_failed:
            return False
        now = time.monotonic()
        recent = [t for t in self._restarted_at[key] if now - t < self._restarts.window_s]
        if len(recent) >= self._restarts.limit:
            if key not in self._given_up:  # said once: every request for it asks again until the process goes
                self._given_up.add(key)
                metrics.observe_engine_restart(key, "given_up")
                log.error("engine %s died (%s) after %d restarts within %.0f s: not replaced again; the process is "
                          "to be replaced", key, why, len(recent), self._restarts.window_s)
            return False
        self._restarted_at[key] = recent + [now]
        log.error("engine %s died (%s): replacing it (restart %d of %d within %.0f s); the other engines serve on",
                  key, why, len(recent) + 1, self._restarts.limit, self._restarts.window_s)
        task = asyncio.get_running_loop().create_task(self._replace(key))
        self._restarting[key] = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _replace(self, key: str) -> None:
        try:
            started = await asyncio.to_thread(self._replace_blocking, key)
        except Exception as e:  # noqa: BLE001 - reported by the health check from now on
            log.exception("engine %s: its replacement failed to start", key)
            self._restart_failed[key] = e
            metrics.observe_engine_restart(key, "failed")
        else:
            if started:
                log.info("engine %s: replaced, serving again", key)
                metrics.observe_engine_restart(key, "replaced")
                self._register(key)
        finally:
            self._restarting.pop(key, None)

    def _replace_blocking(self, key: str) -> bool:
        with self._starting:
            if self._closing:
                return False
            # Listed even when shutdown began meanwhile: it waits for this lock, then stops every listed engine.
            self._engines[key] = self._restart(key, self._engines[key])
            return True

    async def block_size(self, engine_key: str) -> int:
        return int(self._engine(engine_key).block_size)

    async def reasoning_gate(self, engine_key: str) -> bool:
        return bool(self._engine(engine_key).reasoning_gate)

    async def probe(self, engine_key: str) -> None:
        await self._engine(engine_key).check_health()

    async def choose(self, engine_key: str, req: RouteRequest) -> Decision | None:
        # One engine per key in this process: it serves. A Decision (not None) so the request log says why.
        self._engine(engine_key)
        if self._placed(req.request_id):
            self._running[engine_key][req.request_id] = False
            self._claimed.add(req.request_id)
        return Decision(replica_id=self.replica_id, policy=POLICY)

    def prefilled(self, engine_key: str, request_id: str, cached_tokens: int | None = None) -> None:
        if self._placed(request_id):
            running = self._running.get(engine_key, {})
            if request_id in running:
                running[request_id] = True
            self._report(self._router.prefilled.remote(engine_key, request_id, cached_tokens))

    def release(self, engine_key: str, request_id: str, output_tokens: int | None = None) -> None:
        if self._placed(request_id):
            self._running.get(engine_key, {}).pop(request_id, None)
            self._report(self._router.released.remote(engine_key, request_id, output_tokens))

    def settle(self, route_id: str | None, request_id: str | None) -> None:
        """An HTTP request that HAProxy forwarded here has ended (ingress/front_door_reports.py). A route id no
        engine stream took (count_tokens, an error before generation, a client gone first) is told to its Router
        as abandoned. No route id header at all (`None`; an empty one is the Router's "nothing reserved") with
        HAProxy's x-request-id may be a pin-miss Serve's fallback proxy delivered here, so its Router is told it
        arrived unrouted. Either way the reservation is released now instead of at reconcile, RECONCILE_AFTER_S
        later."""
        if self._router is None:
            return
        if route_id:
            if route_id in self._claimed:
                self._claimed.discard(route_id)  # its stream reports its end
            elif self._placed(route_id):
                self._report(self._router.abandoned.remote(route_id))
        elif route_id is None and request_id:
            self._report(self._router.unrouted.remote(request_id))

    def _placed(self, request_id: str) -> bool:
        """Whether a front door Router placed this request (its route id, `<router replica>/<request id>`):
        only then is anything reserved for it."""
        return self._router is not None and "/" in request_id

    def _report(self, response) -> None:
        """Not waited for by the request, but held until it lands."""
        try:
            task = asyncio.get_running_loop().create_task(_settle(response))
        except RuntimeError:  # no loop (a unit test's direct call): nothing to hold it for
            return
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def open(self, engine_key: str, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """Validation (vLLM's own, e.g. an output schema its grammar cannot compile) raises here, before the
        adapter commits a response head; the request enters the engine with the stream's first step."""
        engine = self._engine(engine_key)
        engine.validate(req)
        return engine.generate(req)

    async def num_unfinished(self) -> int:
        return sum([await e.num_unfinished() for key, e in self._engines.items() if key not in self._restarting])

    async def check_health(self) -> None:
        """Serve's (or the single process's) periodic check. A dead engine (vLLM's EngineDeadError after its
        engine core exits) is replaced in place while the others serve on; this raises only when one cannot be:
        its replacement failed to start, or it died more often than `restarts` allows (or this client cannot
        restart engines) — then the whole process is replaced."""
        for key, engine in list(self._engines.items()):
            if key in self._restart_failed:
                raise self._restart_failed[key]
            if key in self._restarting:
                continue
            try:
                await engine.check_health()
            except Exception as e:
                if not self._begin_restart(key, type(e).__name__):
                    raise

    def shutdown(self) -> None:
        """Stop every engine, all at once: each stop waits seconds for its engine core and worker processes to exit
        (vLLM's own teardown, ~4 s on CPU), so one after another the waits added up on every Ctrl-C, redeploy and
        scale-down (config.yaml runs two engines in one replica). A replacement being started is waited for, and
        stopped with the rest."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        with self._starting:
            pass
        stops = [threading.Thread(target=_stop, args=(key, engine), name=f"stop-engine-{key}", daemon=True)
                 for key, engine in self._engines.items()]
        for t in stops:
            t.start()
        for t in stops:
            t.join()


def _stop(key: str, engine) -> None:
    try:
        engine.shutdown()  # AsyncLLM.shutdown: its output-handler task is cancelled thread-safely
    except Exception:  # noqa: BLE001 - stopping the other engines matters more
        log.exception("engine %s: shutdown failed", key)
