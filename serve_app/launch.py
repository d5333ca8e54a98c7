"""`python -m serve_app run CONFIG`: Serve's `serve run CONFIG` on a local Ray started for one host.

`serve run` starts Ray with its cluster defaults, which suit a cluster someone watches: the dashboard (a head
process and nine module processes), a pool of idle workers kept for tasks, every worker reporting its task events
each second for the dashboard's task views, and usage statistics. This app runs actors (each its own process) and
a task or two at deploy time, and on a laptop or one box nobody watches a dashboard; what those cost idle is
CPU the engine's compute shares (docs/serving-path.md "Ray's fixed cost", load/results/idle_launch_*.json).

So this starts the local Ray itself, without them, and then hands the config to `serve run` unchanged: the Serve
config, the app and everything the replicas do are the same either way. `--dashboard` keeps Ray's dashboard (and
with it `serve status`, which asks the dashboard). With `--address` it joins a running Ray cluster as `serve run`
does, leaving that cluster's settings alone (on KubeRay the dashboard is how the operator deploys, so it stays).
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
