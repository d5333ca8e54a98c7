"""The production Serve config (deployments/*.yaml) is valid for Ray Serve and for the app, and says what it must."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app.families import get_family
from serve_app.parsers import REASONING_PARSERS, TOOL_PARSERS
from serve_app.settings import AppSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = sorted((ROOT / "deployments").glob("*.yaml"))
B200 = ROOT / "deployments" / "b200-tp4.yaml"


SERVE_CONFIGS = [*DEPLOYMENTS, ROOT / "config.yaml", ROOT / "tests" / "configs" / "test.yaml"]


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_direct_ingress_is_chosen_once_for_controller_and_ingress(path: Path):
    """The controller (HAProxy, no Python proxy) and the ingress replicas (their own HTTP servers) must agree: a
    controller in direct-ingress mode with proxy-mode ingress replicas, or the reverse, serves nothing."""
    from serve_app.app import _small_options
    from serve_app.serve_tuning import DIRECT_INGRESS, DRAIN_FLOOR, controller_env, direct_ingress_env, direct_ingress_in

    cfg = yaml.safe_load(path.read_text())
    for app in cfg["applications"]:
        settings = AppSettings.model_validate(app["args"])
        assert settings.ingress.direct_ingress == direct_ingress_in(cfg), app["name"]
        env = direct_ingress_env(controller_env(cfg)) if settings.ingress.direct_ingress else None
        replica_env = _small_options(settings.ingress.serve_options(), env=env)["ray_actor_options"]["runtime_env"]
        for key, value in DIRECT_INGRESS.items():
            assert (replica_env["env_vars"].get(key) == value) == settings.ingress.direct_ingress, key
        # The replica holds itself open as long as the controller waits for it (both read the drain floor).
        if settings.ingress.direct_ingress:
            assert replica_env["env_vars"].get(DRAIN_FLOOR) == controller_env(cfg).get(DRAIN_FLOOR), path.name


def test_the_ingress_replicas_get_the_controllers_drain_floor(monkeypatch):
    """build_app runs in the controller's environment: its direct-ingress drain floor reaches the ingress replicas
    (Serve's replica reads it too); without one they keep Serve's default."""
    from serve_app.app import build_app
    from serve_app.serve_tuning import DRAIN_FLOOR

    args = {"models": [{"id": "m", "source": "/nonexistent/m"}], "ingress": {"direct_ingress": True}}

    def ingress_env():
        return build_app(args)._bound_deployment.ray_actor_options["runtime_env"]["env_vars"]

    monkeypatch.delenv(DRAIN_FLOOR, raising=False)
    assert DRAIN_FLOOR not in ingress_env() and ingress_env()["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    monkeypatch.setenv(DRAIN_FLOOR, "3")
    assert ingress_env()[DRAIN_FLOOR] == "3"


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_a_front_door_router_gets_the_request_bodies(path: Path):
    """`router.front_door` keys its choice on the body's prompt: without the controller flag HAProxy passes an
    empty body and every request would be routed on load alone, silently."""
    from serve_app.serve_tuning import front_door_in

    cfg = yaml.safe_load(path.read_text())
    for app in cfg["applications"]:
        if AppSettings.model_validate(app["args"]).router.front_door:
            assert front_door_in(cfg), app["name"]


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_replicas_listen_themselves_only_where_serve_runs_no_proxy(path: Path):
    """`ingress.listen` binds the service port in every ingress replica: a Serve proxy or HAProxy on it would keep
    the replicas from starting, and a config with no proxy and no listener serves nothing over HTTP."""
    cfg = yaml.safe_load(path.read_text())
    for app in cfg["applications"]:
        listens = AppSettings.model_validate(app["args"]).ingress.listen is not None
        assert listens == (cfg.get("proxy_location") == "Disabled"), app["name"]


@pytest.mark.parametrize("path", [p for p in SERVE_CONFIGS if p != B200], ids=lambda p: p.name)
def test_cpu_configs_run_a_quiet_controller(path: Path):
    """The laptop and small-host configs slow Serve's control loop (serve_tuning.QUIET_CONTROLLER); the suite runs
    with it too (tests/configs/test.yaml), so a Serve that misbehaves with it fails CI."""
    from serve_app.serve_tuning import QUIET_CONTROLLER, controller_env, flags_set

    assert flags_set(controller_env(yaml.safe_load(path.read_text())), QUIET_CONTROLLER)


@pytest.fixture(scope="module")
def b200() -> dict:
    return yaml.safe_load(B200.read_text())


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: p.name)
def test_every_deployment_validates_against_serve_and_app_schemas(path: Path):
    cfg = yaml.safe_load(path.read_text())
    ServeDeploySchema.model_validate(cfg)
    for app in cfg["applications"]:
        assert app["import_path"] == "serve_app.app:build_app"
        settings = AppSettings.model_validate(app["args"])
        for m in settings.models:
            assert m.reasoning_parser is None or m.reasoning_parser in REASONING_PARSERS
            assert m.tool_parser is None or m.tool_parser in TOOL_PARSERS


def test_b200_model_runs_tp4_with_the_nemotron_parsers(b200):
    settings = AppSettings.model_validate(b200["applications"][0]["args"])
    (model,) = settings.models
    assert model.model_source == "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4"
    assert model.engine_kwargs["tensor_parallel_size"] == 4
    assert model.engine_kwargs["distributed_executor_backend"] == "ray"
    # The parsers and kwargs come from the catalog entry the family tests prove against Nemotron 3's template.
    family = get_family("nemotron-3")
    assert model.family == "nemotron-3"
    assert (model.reasoning_parser, model.tool_parser) == (family.reasoning_parser, family.tool_parser)
    assert (model.reasoning_parser, model.tool_parser) == ("nemotron_v3", "qwen3_coder")
    assert settings.ingress.strip_preamble and settings.ingress.tool_dispatch


def test_b200_engine_placement_is_four_b200_gpus_on_one_node(b200):
    settings = AppSettings.model_validate(b200["applications"][0]["args"])
    dep = settings.models[0].deployment
    assert dep.placement_group_strategy == "STRICT_PACK"
    bundles = dep.placement_group_bundles
    assert len(bundles) == settings.models[0].engine_kwargs["tensor_parallel_size"]
    assert all(b.get("GPU") == 1 and b.get("accelerator_type:B200", 0) > 0 for b in bundles)
    # Ray Serve puts the replica actor into bundle 0: its CPU ask must fit there.
    assert dep.ray_actor_options["num_cpus"] <= bundles[0].get("CPU", 0)
    assert dep.ray_actor_options.get("num_gpus", 0) == 0


def test_b200_limits_and_autoscaling_are_explicit(b200):
    settings = AppSettings.model_validate(b200["applications"][0]["args"])
    for name, dep in [("engine", settings.models[0].deployment), ("ingress", settings.ingress.deployment)]:
        assert dep.max_ongoing_requests, name
        assert dep.max_queued_requests, name
        auto = dep.autoscaling_config
        assert auto and auto["min_replicas"] <= auto["max_replicas"], name
        assert auto["target_ongoing_requests"] <= dep.max_ongoing_requests, name
    # The router and the ingress never take a GPU.
    for dep in (settings.router.deployment, settings.ingress.deployment):
        assert dep.ray_actor_options.get("num_gpus", 0) == 0
        assert "placement_group_bundles" not in dep.model_dump(exclude_none=True)


def test_b200_pins_the_hash_seed_for_every_process_of_the_app(b200):
    assert b200["applications"][0]["runtime_env"]["env_vars"]["PYTHONHASHSEED"] == "0"


def test_b200_engine_options_build_a_serve_deployment(b200):
    """What build_app hands to `Engine.options(...)` is accepted by Ray Serve (no cluster needed)."""
    from serve_app.app import _engine_options
    from serve_app.engine.deployment import Engine
    from serve_app.service import engine_key

    settings = AppSettings.model_validate(b200["applications"][0]["args"])
    model = settings.models[0]
    dep = Engine.options(**_engine_options(model, engine_key(model)))
    assert dep._deployment_config.max_queued_requests == model.deployment.max_queued_requests
    assert dep._deployment_config.autoscaling_config.max_replicas == model.deployment.autoscaling_config["max_replicas"]
    assert dep._replica_config.placement_group_strategy == "STRICT_PACK"
    assert len(dep._replica_config.placement_group_bundles) == 4


def test_the_store_and_limits_replicas_run_their_code_on_the_replicas_loop():
    """Their methods are async and never block, so like every replica of this app they skip Serve's second thread
    (serve_tuning.SERVE_REPLICA_ENV) and take no CPU of their own to place (num_cpus 0)."""
    from serve_app.ingress.limits_deployment import bind_limits
    from serve_app.ingress.responses.store import bind_store
    from serve_app.serve_tuning import SERVE_REPLICA_ENV

    settings = AppSettings.model_validate({"models": [{"id": "m", "source": "org/x"}],
                                           "ingress": {"tenants": {"a": {"max_concurrent_requests": 2}}}})
    for bound in (bind_store(settings), bind_limits(settings)):
        opts = bound._bound_deployment.ray_actor_options
        assert opts["num_cpus"] == 0
        assert SERVE_REPLICA_ENV.items() <= opts["runtime_env"]["env_vars"].items()
