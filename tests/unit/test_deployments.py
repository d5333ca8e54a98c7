"""The production Serve config (deployments/*.yaml) is valid for Ray Serve and for the app, and says what it must."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from kuberay.generate import gpu_deployments
from serve_app.families import get_family
from serve_app.parsers import REASONING_PARSERS, TOOL_PARSERS
from serve_app.settings import AppSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = sorted((ROOT / "deployments").glob("*.yaml"))
B200 = ROOT / "deployments" / "b200-tp4.yaml"
CODING = ROOT / "deployments" / "b200-coding-models.yaml"


SERVE_CONFIGS = [*DEPLOYMENTS, ROOT / "config.yaml", ROOT / "tests" / "configs" / "test.yaml"]
# Configs any of whose Serve deployments (engines, ingress, router) asks Ray for a GPU.
GPU_CONFIGS = [p for p in DEPLOYMENTS if gpu_deployments(yaml.safe_load(p.read_text()))]
# Ids Claude Code and Codex send by default.
CLIENT_DEFAULT_IDS = ("claude-sonnet-4-6", "claude-opus-4-6", "claude-haiku-4-5", "gpt-5.5")
# Weight formats a checkpoint's repo name may add to the family's model name.
_QUANT_SUFFIX = re.compile(r"-(FP8|NVFP4|MXFP4|INT4|AWQ|GPTQ[-\w]*)$", re.IGNORECASE)


def _gpu_models(path: Path):
    """(app name, the model's entry as written, the validated ModelConfig) for every model of a config."""
    for app in yaml.safe_load(path.read_text())["applications"]:
        settings = AppSettings.model_validate(app["args"])
        for raw, model in zip(app["args"]["models"], settings.models, strict=True):
            yield app["name"], raw, model


def test_the_gpu_configs_are_the_b200_ones():
    """The parametrized GPU checks below cannot shrink to nothing unnoticed: both B200 configs are GPU configs,
    and no CPU config is."""
    assert {B200, CODING} <= set(GPU_CONFIGS)
    assert not [p for p in GPU_CONFIGS if "cpu" in p.name]


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


@pytest.mark.parametrize("path", [p for p in SERVE_CONFIGS if p not in GPU_CONFIGS], ids=lambda p: p.name)
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


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_engine_placement_is_tp_gpus_on_one_node(path: Path):
    """Each engine replica reserves one GPU bundle per tensor-parallel rank, all on one node of one accelerator
    type (STRICT_PACK: PACK may spread ranks over nodes); Ray Serve puts the replica actor into bundle 0, so its CPU
    is there and the actor itself takes no GPU (vLLM's Ray executor runs one rank on each bundle's GPU)."""
    for app in yaml.safe_load(path.read_text())["applications"]:
        assert AppSettings.model_validate(app["args"]).engine_placement == "deployment", app["name"]
    for app, _raw, model in _gpu_models(path):
        where = (app, model.id)
        dep = model.deployment
        tp = model.engine_kwargs["tensor_parallel_size"]
        assert model.engine_kwargs["distributed_executor_backend"] == "ray", where
        assert dep.placement_group_strategy == "STRICT_PACK", where
        bundles = dep.placement_group_bundles
        assert bundles and len(bundles) == tp <= 8, where  # a B200 node has 8 GPUs
        assert all(b.get("GPU") == 1 for b in bundles), where
        accelerators = {k for b in bundles for k in b if k.startswith("accelerator_type:")}
        assert len(accelerators) == 1 and all(b.get(*accelerators, 0) > 0 for b in bundles), where
        if path.name.startswith("b200"):
            assert accelerators == {"accelerator_type:B200"}, where
        assert dep.ray_actor_options["num_cpus"] <= bundles[0].get("CPU", 0), where
        assert all("CPU" not in b for b in bundles[1:]), where
        assert dep.ray_actor_options.get("num_gpus", 0) == 0, where


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_models_name_a_catalog_family_and_keep_its_settings(path: Path):
    """Parsers, thinking and effort kwargs come from the family the catalog proves against the model's template
    (tests/unit/test_families.py): every model names one that lists its checkpoint, and sets none of those fields
    itself to something else, nor a hand-written template in place of the tokenizer's or the family's."""
    for app, raw, model in _gpu_models(path):
        where = (app, model.id)
        assert raw.get("family"), where
        family = get_family(raw["family"])
        assert model.model_source in family.models or _QUANT_SUFFIX.sub("", model.model_source) in family.models, where
        for key in ("reasoning_parser", "tool_parser", "thinking_kwarg", "effort_kwarg", "effort_values"):
            assert raw.get(key, getattr(family, key)) == getattr(family, key), (where, key)
            assert getattr(model, key) == getattr(family, key), (where, key)
        assert family.default_chat_template_kwargs.items() <= model.default_chat_template_kwargs.items(), where
        assert "chat_template" not in raw, where


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_every_client_id_names_exactly_one_model(path: Path):
    """A model id or alias (e.g. Claude Code's `claude-sonnet-4-6`) listed on two models would send a client to
    either; counted on the file as written, and each id finds the model that lists it."""
    for app in yaml.safe_load(path.read_text())["applications"]:
        ids = [i for m in app["args"]["models"] for i in [m["id"], *m.get("aliases", [])]]
        assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
        settings = AppSettings.model_validate(app["args"])
        for model in settings.models:
            assert all(settings.find_model(i) is model for i in model.all_ids), model.id


def test_an_alias_on_two_models_is_refused():
    """AppSettings itself refuses it, so a deploy with one fails at once instead of serving either model."""
    args = yaml.safe_load(CODING.read_text())["applications"][0]["args"]
    args["models"][1]["aliases"] = [*args["models"][1].get("aliases", []), args["models"][0]["aliases"][0]]
    with pytest.raises(ValidationError, match="listed twice"):
        AppSettings.model_validate(args)


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_limits_and_autoscaling_are_explicit(path: Path):
    for app in yaml.safe_load(path.read_text())["applications"]:
        settings = AppSettings.model_validate(app["args"])
        parts = [(m.id, m.deployment) for m in settings.models] + [("ingress", settings.ingress.deployment)]
        for name, dep in parts:
            assert dep.max_ongoing_requests, name
            assert dep.max_queued_requests, name
            auto = dep.autoscaling_config
            assert auto and auto["min_replicas"] <= auto["max_replicas"], name
            assert auto["target_ongoing_requests"] <= dep.max_ongoing_requests, name
            # Running agent turns finish when a replica drains.
            assert dep.graceful_shutdown_timeout_s and dep.graceful_shutdown_timeout_s >= 300, name
        # The router and the ingress never take a GPU.
        for dep in (settings.router.deployment, settings.ingress.deployment):
            assert dep.ray_actor_options.get("num_gpus", 0) == 0
            assert "placement_group_bundles" not in dep.model_dump(exclude_none=True)


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_config_pins_the_hash_seed_for_every_process_of_the_app(path: Path):
    for app in yaml.safe_load(path.read_text())["applications"]:
        assert app["runtime_env"]["env_vars"]["PYTHONHASHSEED"] == "0", app["name"]


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_engine_options_build_a_serve_deployment(path: Path):
    """What build_app hands to `Engine.options(...)` is accepted by Ray Serve (no cluster needed), and the app
    binds one Engine deployment per model with its own placement."""
    from serve_app.app import _engine_options, build_app
    from serve_app.engine.deployment import Engine
    from serve_app.service import engine_key

    for app in yaml.safe_load(path.read_text())["applications"]:
        settings = AppSettings.model_validate(app["args"])
        for model in settings.models:
            dep = Engine.options(**_engine_options(model, engine_key(model)))
            assert dep._deployment_config.max_queued_requests == model.deployment.max_queued_requests
            assert (dep._deployment_config.autoscaling_config.max_replicas
                    == model.deployment.autoscaling_config["max_replicas"])
            assert dep._replica_config.placement_group_strategy == "STRICT_PACK"
            assert len(dep._replica_config.placement_group_bundles) == model.engine_kwargs["tensor_parallel_size"]
        engines = build_app(app["args"])._bound_deployment.init_args[2]
        assert set(engines) == {engine_key(m) for m in settings.models} and len(engines) == len(settings.models)
        for model in settings.models:
            bound = engines[engine_key(model)]._bound_deployment
            assert bound._replica_config.placement_group_bundles == model.deployment.placement_group_bundles


def test_coding_models_config_serves_four_families_each_on_its_own_engine():
    """deployments/b200-coding-models.yaml: the four families at the tensor-parallel sizes their weights need on
    B200 (Kimi K2 Thinking's ~594 GB INT4 takes a whole node for KV room), and every client default id answered."""
    settings = AppSettings.from_yaml(CODING)
    got = {m.family: (m.model_source, m.engine_kwargs["tensor_parallel_size"]) for m in settings.models}
    assert got == {
        "qwen3-coder": ("Qwen/Qwen3-Coder-480B-A35B-Instruct-FP8", 4),
        "glm-4.6": ("zai-org/GLM-4.6-FP8", 4),
        "kimi-k2": ("moonshotai/Kimi-K2-Thinking", 8),
        "gpt-oss": ("openai/gpt-oss-120b", 1),
    }
    assert all(settings.find_model(i) is not None for i in CLIENT_DEFAULT_IDS)
    (oss,) = [m for m in settings.models if m.family == "gpt-oss"]
    assert oss.deployment.autoscaling_config["min_replicas"] >= 2  # several single-GPU replicas
    assert settings.router.policy == "ttft" and settings.router.placement == "deployment"
    assert settings.ingress.direct_ingress and settings.ingress.strip_preamble and settings.ingress.tool_dispatch


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
