"""build_app(args) -> the Ray Serve application. The only place deployments are wired.

    Ingress (FastAPI, CPU) ──▶ Router (KV index + load, one per app) ──▶ Engine-<model> (vLLM, one per weights)

or, with `engine_placement: ingress`, the Ingress alone with the engines in each of its replicas — and with
`router.front_door` a Router that Serve's HAProxy asks which ingress replica holds each request's prefix.

Models whose weights and engine settings are equal share one Engine deployment (`service.engine_key`), so one
engine can be served under several ids with different parsers or chat templates.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from serve_app import keyring
from serve_app.engine.deployment import Engine
from serve_app.engine.provision import EMBEDDED, ensure_model
from serve_app.ingress.deployment import Ingress
from serve_app.ingress.limits_deployment import bind_limits
from serve_app.ingress.responses.store import bind_store
from serve_app.routing.deployment import Router
from serve_app.routing.front_door_deployment import FrontDoorRouter
from serve_app.routing.registry import make_policy
from serve_app.serve_tuning import FRONT_DOOR, direct_ingress_env, flags_set, with_replica_env
from serve_app.service import engine_key
from serve_app.settings import AppSettings, ModelConfig

log = logging.getLogger(__name__)


def _engine_options(model: ModelConfig, key: str) -> dict[str, Any]:
    opts = model.deployment.serve_options()
    actor = dict(opts.pop("ray_actor_options", {}) or {})
    actor.setdefault("num_cpus", 0.5)
    opts["ray_actor_options"] = with_replica_env(actor, model.engine_env)
    opts["name"] = key
    opts["request_router_config"] = RequestRouterConfig(
        request_router_class="serve_app.routing.serve_router:TargetReplicaRouter",
        # It reports Serve's live replicas of this engine to the Router, which drops dead ones.
        request_router_kwargs={"engine_key": key},
    )
    return opts


def _small_options(opts: dict[str, Any], default_cpus: float = 0.0, env: dict[str, str] | None = None) -> dict[str, Any]:
    actor = dict(opts.pop("ray_actor_options", {}) or {})
    actor.setdefault("num_cpus", default_cpus)
    opts["ray_actor_options"] = with_replica_env(actor, env)
    return opts


def build_app(args: dict[str, Any]) -> serve.Application:
    settings = AppSettings.model_validate(args)
    # Convert embedded default weights once here, so the engine and the ingress don't both do it on first start.
    for m in settings.models:
        if m.model_source in EMBEDDED:
            ensure_model(m.model_source, settings.model_cache_dir)

    # One key ring for all ingress replicas: thinking signatures and encrypted reasoning must verify on any of
    # them, and after a restart (serve_app/keyring.py). Test configs may run on a random key without a warning.
    secret = keyring.load(settings.ingress.server_secret, warn=not settings.testing.forced_scripts)
    ingress_env = direct_ingress_env(os.environ) if settings.ingress.direct_ingress else None
    if settings.engine_placement == "ingress":
        return _ingress_with_engines(settings, secret, ingress_env)

    make_policy(settings.router.policy)  # an unknown policy name fails here, not in the Router replica
    router_opts = _small_options(settings.router.deployment.serve_options())
    router = Router.options(**router_opts).bind(settings.router.model_dump())

    engines: dict[str, Any] = {}
    for m in settings.models:
        key = engine_key(m)
        if key in engines:
            continue
        engines[key] = Engine.options(**_engine_options(m, key)).bind(
            m.model_dump(),
            engine_key=key,
            forced_scripts=settings.testing.forced_scripts,
            kv_events=settings.router.kv_events,
            model_cache_dir=settings.model_cache_dir,
            router=router,
        )

    return Ingress.options(**_small_options(settings.ingress.serve_options(), env=ingress_env)).bind(
        settings.model_dump(), secret, engines, router, bind_store(settings), bind_limits(settings)
    )


def _ingress_with_engines(settings: AppSettings, secret, ingress_env: dict[str, str] | None) -> serve.Application:
    """`engine_placement: ingress`: the Ingress deployment alone (with the stores it uses); each replica starts
    the engines in its own process, so it carries their environment and their resources."""
    env = dict(ingress_env or {})
    for m in settings.models:
        env.update(m.engine_env)
    opts = _small_options(settings.ingress.serve_options(), default_cpus=0.5, env=env)
    if settings.router.front_door:
        # Serve's request router of the Ingress deployment: only the front door's Router calls it, to name the
        # replica its table chose (and to report the live replicas to that table, per engine key).
        opts["request_router_config"] = RequestRouterConfig(
            request_router_class="serve_app.routing.serve_router:TargetReplicaRouter",
            request_router_kwargs={"engine_keys": sorted({engine_key(m) for m in settings.models})},
        )
    store = bind_store(settings)  # one deployment, read by the front door's Router too
    ingress = Ingress.options(**opts).bind(settings.model_dump(), secret, {}, None, store, bind_limits(settings))
    if not settings.router.front_door:
        return ingress
    make_policy(settings.router.policy)
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" and not flags_set(os.environ, FRONT_DOOR):
        # Built where the controller's flags are (serve run / deploy of a config): HAProxy would send empty bodies.
        log.warning("router.front_door without %s in controller_options.runtime_env.env_vars: every request "
                    "will be routed on load alone", ", ".join(f"{k}={v}" for k, v in FRONT_DOOR.items()))
    router_opts = _small_options(settings.router.deployment.serve_options())
    router_opts.pop("num_replicas", None)  # Serve runs one per proxy node (RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE)
    router = FrontDoorRouter.options(**router_opts).bind(settings.model_dump(), secret, ingress, store)
    # Serve's hook (internal in Ray 2.60; Ray Serve LLM's direct streaming uses it): HAProxy asks `router` which
    # replica of `ingress` to forward each request to (routing/front_door_deployment.py).
    return ingress._with_ingress_request_router(router)
