"""`python -m serve_app run CONFIG --single-process`: the whole service in this one process, without Ray.

What it runs is config.yaml's topology with Ray's processes taken away: the same ingress (routes, parsers,
GenerationService, the Responses store, tenant keys and limits), the engines in this process
(`engine_placement: ingress`, engine/local_client.py) and the same uvicorn listener on `ingress.listen` — built by
the same `build_context` the Serve replica uses. Ray's daemons (GCS, raylet, log monitor, metrics agent) and Serve's
controller are what keep one stream's CPU above vLLM's own server's on a Ray Serve app (docs/serving-path.md "Ray's
fixed cost"); this is the design without them, for one host where nothing needs Ray: a laptop, a single-GPU box.

What it gives up, by design: Serve's replicas (one process is one ingress replica: `num_replicas` 1), autoscaling,
the front door, Engine deployments and multi-node placement — a config asking for those is refused with the reason.
A dead engine is replaced in place while the other engines serve on (`engine_restarts`, as in a Serve replica);
one that cannot be (its replacement fails to start, or it keeps dying) makes the process exit with status 1 so
that its supervisor (systemd, a container runtime) restarts it, as Serve would replace the replica. `/metrics`
serves this process's registries: the service's metrics and each engine's vLLM metrics under their own names
(without Ray's `ray_` export prefix).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from serve_app.settings import AppSettings

log = logging.getLogger(__name__)

# How often the engines' health is checked: Serve's default health-check period for a replica.
HEALTH_PERIOD_S = 10.0


def refusals(settings: AppSettings) -> list[str]:
    """Why `settings` cannot run in one process without Ray (empty: it can)."""
    out = []
    if settings.engine_placement != "ingress":
        out.append("engine_placement: deployment runs each engine as a Ray Serve deployment; one process needs "
                   "engine_placement: ingress (as config.yaml)")
    if settings.ingress.listen is None:
        out.append("ingress.listen is unset: it is the address this process serves (config.yaml: 0.0.0.0:8000)")
    if settings.router.front_door:
        out.append("router.front_door routes among ingress replicas through Serve's HAProxy; one process is one "
                   "replica")
    dep = settings.ingress.deployment
    if dep.autoscaling_config is not None or dep.num_replicas != 1:
        out.append("ingress.deployment asks for several ingress replicas (num_replicas / autoscaling_config); one "
                   "process is one replica: run the config on Ray instead")
    return out


def _limit_state(settings: AppSettings) -> Any:
    """The tenants' limit state, kept in this process (the only one counting), or None without limits."""
    if not settings.ingress.tenants_limited:
        return None
    from serve_app.limits import LimitState

    return LimitState()


async def _engines_failed(engines: Any, period_s: float) -> BaseException:
    """Returns the error once an engine is dead past replacing (checked every `period_s`; a dead engine that can
    be replaced is, by the check itself)."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await engines.check_health()
        except Exception as e:  # noqa: BLE001 - any failure of the check is an engine past replacing
            return e


async def serve(settings: AppSettings, health_period_s: float = HEALTH_PERIOD_S) -> int:
    """Start the engines, serve `ingress.listen` until SIGINT/SIGTERM (0) or an engine dies past replacing (1),
    then let open requests finish (`listen.drain_s`) and stop the engines. Returns the exit status."""
    from serve_app import keyring
    from serve_app.engine.local_client import LocalEngineClient
    from serve_app.engine.stat_logger import LocalEngineStatLogger
    from serve_app.ingress.context import build_context
    from serve_app.ingress.listener import Listener
    from serve_app.ingress.responses.store import open_local_store
    from serve_app.ingress.server import create_app
    from serve_app.serve_tuning import freeze_startup_heap

    secret = keyring.load(settings.ingress.server_secret, warn=not settings.testing.forced_scripts)
    engines = LocalEngineClient.start(settings.models, forced_scripts=settings.testing.forced_scripts,
                                      model_cache_dir=settings.model_cache_dir, replica_id="single-process",
                                      stat_loggers=[LocalEngineStatLogger], restarts=settings.engine_restarts)
    listener = None
    try:
        # Every placement's store opens here: this process is the only one using it (so `memory` works too).
        ctx = build_context(settings, secret, engines, limits=_limit_state(settings),
                            response_store=open_local_store(settings.ingress))
        listen = settings.ingress.listen
        listener = Listener(create_app(ctx), listen.host, listen.port, listen.keep_alive_s, listen.drain_s)
        freeze_startup_heap()  # as a replica does after start-up (serve_tuning.py)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        listener.start()
        log.info("serving on http://%s:%d in one process (no Ray)", listen.host, listener.port)
        waits = {loop.create_task(stop.wait()): "stop", listener.task: "listener",
                 loop.create_task(_engines_failed(engines, health_period_s)): "health"}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            if task is not listener.task:
                task.cancel()
        why = waits[next(iter(done))]
        if why == "health":
            log.error("an engine died and cannot be replaced here (%r): stopping, for the supervisor to restart "
                      "the service", next(iter(done)).result())
        return 0 if why == "stop" else 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # Python's own handlers again
            asyncio.get_running_loop().remove_signal_handler(sig)
        if listener is not None:
            await listener.drain()
        await asyncio.to_thread(engines.shutdown)


def run(settings: AppSettings) -> int:
    """The command's entry: refuse what needs Ray, else serve until interrupted. Returns the exit status."""
    problems = refusals(settings)
    if problems:
        for p in problems:
            log.error("--single-process: %s", p)
        return 2
    # One OpenMP thread for what torch runs outside the engine's worker (this process, the engine core), as Ray
    # gives its workers (the actor's num_cpus, at least 1) and vLLM its multiprocess workers, so the processes run
    # as they do under Serve; the worker binds its own threads (VLLM_CPU_OMP_THREADS_BIND). Unset, each had a
    # thread per core beside the worker's (docs/serving-path.md "One process without Ray"). Set before torch is
    # imported; an operator's own value wins.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A SIGTERM while the engines start (a supervisor's stop) unwinds like Ctrl-C does, so the engines started so
    # far and the one starting are stopped; by default it would end the process at once and leave their processes
    # running. Once serving, the event loop's own handler takes over (`serve`).
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        # uvloop where installed, as Serve's replicas and vLLM's server run their event loops (on the default loop
        # the first token reached a client 36 ms later at one stream:
        # load/results/capacity_single_process_asyncio_loop.json).
        try:
            import uvloop
        except ImportError:
            return asyncio.run(serve(settings))
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(serve(settings))
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
