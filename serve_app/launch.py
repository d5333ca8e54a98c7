"""`python -m serve_app run CONFIG`: Serve's `serve run CONFIG` on a local Ray started for one host.

`serve run` starts Ray with its cluster defaults, which suit a cluster someone watches: the dashboard (a head
process and nine module processes), a pool of idle workers kept for tasks, every worker reporting its task events
each second for the dashboard's task views, and usage statistics. This app runs actors (each its own process) and
a task or two at deploy time, and on a laptop or one box nobody watches a dashboard; what those cost idle is
CPU the engine's compute shares (docs/serving-path.md "Ray's fixed cost", load/results/idle_launch_*.json).

So this starts the local Ray itself, without them, and then hands the config to `serve run` unchanged: the Serve
config, the app and everything the replicas do are the same either way. `--dashboard` keeps Ray's dashboard (and
with it `serve status`, which asks the dashboard; `python -m serve_app status` asks Serve's controller itself, so it
works without one). With `--address` it joins a running Ray cluster as `serve run` does, leaving that cluster's
settings alone (on KubeRay the dashboard is how the operator deploys, so it stays).
Settings an operator exports (`RAY_USAGE_STATS_ENABLED`, `RAY_<system config>`) win over these.
"""

from __future__ import annotations

import os
from typing import Any

# Ray system settings for a local single-host Ray (passed as `_system_config`, which every Ray process of the
# cluster reads).
LEAN_SYSTEM_CONFIG: dict[str, Any] = {
    # Ray keeps up to num_cpus started idle workers for tasks, each a Python process polling its raylet. This app's
    # processes are actors; a deploy-time task gets a worker started for it, stopped once idle.
    "num_workers_soft_limit": 0,
    # 0 turns off each worker's task-event buffer, which otherwise sends task events every second for the
    # dashboard's task views and `ray list tasks`: with no dashboard, to nobody.
    "task_events_report_interval_ms": 0,
}

# The environment Ray's processes start with, unless the operator set it: no usage-statistics reports.
LEAN_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}

SERVE_NAMESPACE = "serve"  # what `serve run` passes to ray.init (ray.serve._private.constants.SERVE_NAMESPACE)


def system_config(environ: dict[str, str] | os._Environ = os.environ) -> dict[str, Any]:
    """LEAN_SYSTEM_CONFIG less what the operator set as `RAY_<name>` (Ray would let ours win over theirs)."""
    return {k: v for k, v in LEAN_SYSTEM_CONFIG.items() if f"RAY_{k}" not in environ}


def ray_init_kwargs(dashboard: bool, environ: dict[str, str] | os._Environ = os.environ) -> dict[str, Any]:
    """ray.init's arguments for a new local Ray on this host."""
    return {"address": "local", "namespace": SERVE_NAMESPACE, "include_dashboard": dashboard,
            "_system_config": system_config(environ) or None}


def serve_run_argv(config: str, address: str | None) -> list[str]:
    """`serve run`'s arguments: joining `address` when given; otherwise the Ray this process started (serve run
    uses the Ray already initialised in its process)."""
    return ["run", *(["--address", address] if address else []), config]


def run(config: str, dashboard: bool = False, address: str | None = None) -> int:
    """Serve `config` until interrupted (Ctrl-C, SIGINT: `serve run` then shuts Serve down, and this process's Ray
    goes with it). Returns the exit status."""
    import ray
    from ray.serve.scripts import cli

    if address is None:
        for k, v in LEAN_ENV.items():
            os.environ.setdefault(k, v)  # before Ray starts, so its daemons inherit it
        ray.init(**ray_init_kwargs(dashboard))
    try:
        cli.main(serve_run_argv(config, address), prog_name="serve", standalone_mode=False)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return 0


def status_summary(status: Any) -> dict[str, Any]:
    """A `ServeStatus` (`serve.status()`) as plain data, in the shape of `serve status`'s: the proxies, and per
    application its status, message and deployments (status, message, replicas per state)."""

    def name(v: Any) -> str:
        return getattr(v, "value", v)

    return {
        "proxies": {node: name(state) for node, state in status.proxies.items()},
        "applications": {
            app: {"status": name(ov.status), "message": ov.message, "last_deployed_time_s": ov.last_deployed_time_s,
                  "deployments": {dep: {"status": name(d.status), "status_trigger": name(d.status_trigger),
                                        "replica_states": {name(k): n for k, n in d.replica_states.items()},
                                        "message": d.message}
                                  for dep, d in ov.deployments.items()}}
            for app, ov in status.applications.items()},
        # A number or None; ServeStatus's own default is a pydantic FieldInfo (Ray's dataclass borrows a Field).
        "target_capacity": status.target_capacity if isinstance(status.target_capacity, (int, float)) else None,
    }


def status(address: str | None = None) -> dict[str, Any]:
    """The running service's status, from Serve's controller (no dashboard needed, unlike `serve status`)."""
    import ray
    from ray import serve

    ray.init(address=address or "auto", namespace=SERVE_NAMESPACE, log_to_driver=False, logging_level="ERROR")
    try:
        return status_summary(serve.status())
    finally:
        ray.shutdown()
