"""`python -m serve_app run`: a local Ray started without what a one-host service does not use, then Serve's own
`serve run` with the config unchanged; joining a running cluster leaves that cluster alone. (That it starts, serves
and stops for real: tests/integration/test_serve_app_run.py.)"""

from __future__ import annotations

import os

import pytest

from load.bench_capacity import serve_command
from serve_app import __main__ as cli_main
from serve_app import launch


def test_a_new_local_ray_is_lean_and_in_serves_namespace():
    kw = launch.ray_init_kwargs(dashboard=False, environ={})
    assert kw["address"] == "local" and kw["namespace"] == "serve" and kw["include_dashboard"] is False
    assert kw["_system_config"] == {"num_workers_soft_limit": 0, "task_events_report_interval_ms": 0}
    assert launch.ray_init_kwargs(dashboard=True, environ={})["include_dashboard"] is True


def test_the_operators_ray_settings_win():
    # Ray lets `_system_config` override RAY_<name>; an operator who exported one meant it.
    kw = launch.ray_init_kwargs(dashboard=False, environ={"RAY_num_workers_soft_limit": "4"})
    assert kw["_system_config"] == {"task_events_report_interval_ms": 0}
    both = {f"RAY_{k}": "1" for k in launch.LEAN_SYSTEM_CONFIG}
    assert launch.ray_init_kwargs(dashboard=False, environ=both)["_system_config"] is None


def test_serve_run_gets_the_config_and_only_an_explicit_address():
    assert launch.serve_run_argv("config.yaml", None) == ["run", "config.yaml"]
    assert launch.serve_run_argv("c.yaml", "ray://head:10001") == ["run", "--address", "ray://head:10001", "c.yaml"]


class _Recorder:
    def __init__(self):
        self.init_kwargs, self.argv, self.shutdowns, self.env_at_init = None, None, 0, None


@pytest.fixture
def recorded(monkeypatch):
    import ray
    from ray.serve import scripts

    rec = _Recorder()
    state = {"up": False}

    def init(**kw):
        rec.init_kwargs, rec.env_at_init, state["up"] = kw, dict(os.environ), True

    def shutdown():
        rec.shutdowns += 1
        state["up"] = False

    def main(argv, prog_name, standalone_mode):
        assert prog_name == "serve" and standalone_mode is False
        rec.argv = argv

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", shutdown)
    monkeypatch.setattr(ray, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(scripts.cli, "main", main)
    return rec


def test_run_starts_ray_then_serve_run_then_stops_ray(recorded, monkeypatch):
    monkeypatch.delenv("RAY_USAGE_STATS_ENABLED", raising=False)
    assert launch.run("config.yaml") == 0
    assert recorded.init_kwargs["address"] == "local" and recorded.init_kwargs["include_dashboard"] is False
    assert recorded.env_at_init["RAY_USAGE_STATS_ENABLED"] == "0"  # set before Ray's daemons start
    assert recorded.argv == ["run", "config.yaml"]
    assert recorded.shutdowns == 1


def test_run_keeps_an_operators_usage_stats_choice(recorded, monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")
    launch.run("config.yaml", dashboard=True)
    assert recorded.env_at_init["RAY_USAGE_STATS_ENABLED"] == "1"
    assert recorded.init_kwargs["include_dashboard"] is True


def test_run_on_a_running_cluster_starts_no_ray(recorded):
    launch.run("config.yaml", address="auto")
    assert recorded.init_kwargs is None and recorded.shutdowns == 0
    assert recorded.argv == ["run", "--address", "auto", "config.yaml"]


def test_run_stops_its_ray_when_serve_run_fails(recorded, monkeypatch):
    from ray.serve import scripts

    def fail(*a, **k):
        raise SystemExit(1)

    monkeypatch.setattr(scripts.cli, "main", fail)
    with pytest.raises(SystemExit):
        launch.run("config.yaml")
    assert recorded.shutdowns == 1


def test_cli_run_command(monkeypatch):
    seen = {}
    monkeypatch.setattr(launch, "run", lambda config, dashboard, address: seen.update(
        config=config, dashboard=dashboard, address=address) or 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli_main.main(["run", "config.yaml"]) == 0
    assert seen == {"config": "config.yaml", "dashboard": False, "address": None}
    cli_main.main(["run", "x.yaml", "--dashboard", "--address", "auto"])
    assert seen == {"config": "x.yaml", "dashboard": True, "address": "auto"}


def test_cli_run_joins_ray_address_like_serve_run(monkeypatch):
    seen = {}
    monkeypatch.setattr(launch, "run", lambda config, dashboard, address: seen.update(address=address) or 0)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    cli_main.main(["run", "config.yaml"])
    assert seen["address"] == "10.0.0.1:6379"


def test_load_scripts_start_the_readmes_command_by_default():
    assert serve_command("/tmp/c.yaml")[1:] == ["-m", "serve_app", "run", "/tmp/c.yaml"]
    assert serve_command("/tmp/c.yaml", "serve")[-4:] == ["run", "--address", "local", "/tmp/c.yaml"]


def _serve_status(app_status: str = "RUNNING"):
    """A ServeStatus built from Ray Serve's own types, as serve.status() returns it."""
    from ray.serve._private.common import DeploymentStatus, DeploymentStatusTrigger, ReplicaState
    from ray.serve.schema import ApplicationStatus, ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

    dep = DeploymentStatusOverview(status=DeploymentStatus.HEALTHY,
                                   status_trigger=DeploymentStatusTrigger.CONFIG_UPDATE_COMPLETED,
                                   replica_states={ReplicaState.RUNNING: 2, ReplicaState.STARTING: 1}, message="")
    app = ApplicationStatusOverview(status=ApplicationStatus(app_status), message="", last_deployed_time_s=12.5,
                                    deployments={"Ingress": dep})
    return ServeStatus(applications={"default": app})


def test_status_summary_is_plain_data_in_serve_statuss_shape():
    import json

    summary = launch.status_summary(_serve_status())
    assert json.loads(json.dumps(summary)) == summary  # plain data: prints as JSON or YAML
    assert summary["applications"] == {"default": {
        "status": "RUNNING", "message": "", "last_deployed_time_s": 12.5,
        "deployments": {"Ingress": {"status": "HEALTHY", "status_trigger": "CONFIG_UPDATE_COMPLETED",
                                    "replica_states": {"RUNNING": 2, "STARTING": 1}, "message": ""}}}}


@pytest.mark.parametrize("app_status,rc", [("RUNNING", 0), ("DEPLOYING", 3), ("UNHEALTHY", 3)])
def test_the_status_command_exits_0_only_when_every_app_runs(monkeypatch, capsys, app_status, rc):
    import yaml

    monkeypatch.setattr(launch, "status", lambda address=None: launch.status_summary(_serve_status(app_status)))
    assert cli_main.main(["status"]) == rc
    assert yaml.safe_load(capsys.readouterr().out)["applications"]["default"]["status"] == app_status


def test_the_status_command_says_when_nothing_runs(monkeypatch, capsys):
    def no_ray(address=None):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(launch, "status", no_ray)
    assert cli_main.main(["status"]) == 1
    assert "no running service found" in capsys.readouterr().err
