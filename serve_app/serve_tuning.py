"""Ray Serve's per-process settings for this app's replicas, chosen for streaming many small deltas.

Serve reads these from the environment of each replica process when it starts, so the app sets them on its own
deployments (`runtime_env.env_vars`) instead of asking operators to export flags. The one topology choice,
direct ingress, is the Serve config's (`DIRECT_INGRESS` below); the rest only changes how each replica runs its
own code. Measured with
load/bench_capacity.py (docs/serving-path.md): every token crosses engine replica -> ingress as one item, and
the per-item cost of Serve's defaults is what bounded the path.

- User code on the replica's own event loop: by default Serve runs it on a second thread and hands every
  yielded item across threads (`call_soon_threadsafe`) to the loop that reports it to Ray. All of this app's
  deployment code is async and never blocks its loop for long (a long prompt's tokenizing runs in a thread; small
  renders run on the loop, PromptRenderer.render).
- The handle's request router on the same loop, for the same reason: each engine call otherwise crosses threads.
- Request-path logs buffered (flushed when full or on an error line) rather than flushed per request.
"""

from __future__ import annotations

from typing import Any

SERVE_REPLICA_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
}


# Direct ingress: HAProxy in front of the ingress replicas, each serving HTTP itself, instead of Serve's Python
# proxy relaying every SSE write over one more process hop. This is topology, so it is chosen in the Serve config
# (`ingress.direct_ingress` and these flags in `controller_options.runtime_env.env_vars`, which the controller
# reads), never by an operator's environment; tests/unit/test_deployments.py keeps the two in agreement.
DIRECT_INGRESS = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}


# How long Serve holds a stopping direct-ingress replica open at least, and its controller waits for it: 30 s by
# default, for a load balancer outside Ray (an ALB) to deregister the replica. Serve's own HAProxy hears of the stop
# from the controller and retries a connection the replica refuses, so the one-host configs set a few seconds: Ctrl-C,
# a redeploy or a scale-down then takes seconds, not half a minute. Read by the controller (its
# `controller_options.runtime_env.env_vars`) and by the ingress replica, which gets the controller's value
# (`direct_ingress_env`); a config that does not set it keeps Serve's default.
DRAIN_FLOOR = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


def direct_ingress_env(controller_environ: Any) -> dict[str, str]:
    """The ingress replicas' environment for direct ingress, given the controller's (where `build_app` runs)."""
    env = dict(DIRECT_INGRESS)
    if DRAIN_FLOOR in controller_environ:
        env[DRAIN_FLOOR] = controller_environ[DRAIN_FLOOR]
    return env


# The front door's routing (`router.front_door`): HAProxy passes each request's body to the Router's
# /internal/route (routing/front_door_deployment.py), which needs it to find the prompt's prefix. Read by Serve's
# HAProxy manager, so it is the controller's too (`controller_options.runtime_env.env_vars`).
FRONT_DOOR = {"RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1"}


# The controller's control loop every 0.5 s instead of Serve's 0.1 s on the CPU configs (a laptop, a small host):
# its polling was the largest single CPU cost of the idle service, and on a host the engine's compute shares, every
# core-millisecond of it is the engine's (load/bench_idle.py). What it delays is Serve's reaction to a state change
# (a replica started or lost) by at most 0.4 s. The GPU configs keep Serve's default.
QUIET_CONTROLLER = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}


def flags_set(env: Any, flags: dict[str, str]) -> bool:
    """Whether `env` (a mapping: a config's env_vars, os.environ) has every one of `flags`."""
    return all(env.get(k) == v for k, v in flags.items())


def controller_env(serve_config: dict[str, Any]) -> dict[str, str]:
    return (((serve_config.get("controller_options") or {}).get("runtime_env") or {}).get("env_vars") or {})


def front_door_in(serve_config: dict[str, Any]) -> bool:
    """Whether a Serve config's controller passes request bodies to an ingress request router."""
    return flags_set(controller_env(serve_config), FRONT_DOOR)


def direct_ingress_in(serve_config: dict[str, Any]) -> bool:
    """Whether a Serve config's controller runs direct ingress (both flags set)."""
    return flags_set(controller_env(serve_config), DIRECT_INGRESS)


def with_replica_env(actor_options: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """`ray_actor_options` with Serve's replica settings under the operator's `runtime_env.env_vars`, and `env`
    (a model's `engine_env`) over both."""
    actor = dict(actor_options)
    runtime_env = dict(actor.get("runtime_env") or {})
    runtime_env["env_vars"] = {**SERVE_REPLICA_ENV, **runtime_env.get("env_vars", {}), **(env or {})}
    actor["runtime_env"] = runtime_env
    return actor


def app_watches_disconnects() -> bool:
    """Have Ray Serve's direct-ingress wrapper leave client disconnects to the app in this replica's process, as if
    every request carried Serve's `x-request-disconnect-disabled: ?1`: the wrapper then awaits the app directly
    instead of starting a receive task and a request task and waiting on both, so a new request reaches the app
    turns of a busy event loop sooner. The app must watch disconnects itself (ingress/streaming.py: Starlette's
    StreamingResponse does for streams, `until_disconnected` for the rest). Serve reads the header through a module
    function of its replica; returns False (and changes nothing) where this Ray has none by that name."""
    from ray.serve._private import replica

    if not callable(getattr(replica, "parse_disconnect_disabled_header", None)):
        return False
    replica.parse_disconnect_disabled_header = _disconnects_are_the_apps
    return True


def _disconnects_are_the_apps(headers: Any) -> bool:
    return True


def freeze_startup_heap() -> int:
    """Move everything a replica built at start-up (Ray, Serve, vLLM, torch, tokenizers: ~700K objects) out of the
    garbage collector's reach, as vLLM's API server and engine core do after their own start-up. Otherwise every
    full collection walks that heap again: ~0.4-0.8 s with the event loop stopped on these hosts, which a streamed
    request sees as a stall in its first token or between two tokens. Call it last in a replica's constructor.
    Returns the number of objects frozen."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
