"""The single-process server (serve_app/single_process.py) without vLLM: which configs it refuses and why, the
command's flags, and its lifecycle — serving the port, stopping on SIGINT (0), stopping when an engine dies (1),
the engines stopped either way. The real engines run in tests/integration/test_single_process.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from serve_app import __main__ as cli_main
from serve_app import single_process
from serve_app.engine.stat_logger import LocalEngineStatLogger
from serve_app.engine.vllm_engine import free_port
from serve_app.settings import AppSettings

ROOT = Path(__file__).resolve().parents[2]


def test_config_yaml_runs_in_one_process():
    assert single_process.refusals(AppSettings.from_yaml(ROOT / "config.yaml")) == []


def test_what_needs_ray_is_refused_with_the_reason():
    settings = AppSettings.from_yaml(ROOT / "deployments" / "cpu-engine-deployments.yaml")
    reasons = single_process.refusals(settings)
    assert any("engine_placement" in r for r in reasons), reasons
    assert any("ingress.listen" in r for r in reasons), reasons

    base = AppSettings.from_yaml(ROOT / "config.yaml").model_dump()
    base["ingress"]["deployment"] = {"num_replicas": 2}
    assert ["num_replicas" in r for r in single_process.refusals(AppSettings.model_validate(base))] == [True]
    base["ingress"]["deployment"] = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}
    assert ["autoscaling_config" in r for r in single_process.refusals(AppSettings.model_validate(base))] == [True]


def test_the_command_refuses_a_config_that_needs_ray(capsys, caplog):
    rc = cli_main.main(["run", str(ROOT / "deployments" / "cpu-engine-deployments.yaml"), "--single-process"])
    assert rc == 2
    assert "engine_placement" in caplog.text


def test_ray_flags_do_not_apply_to_one_process(capsys):
    assert cli_main.main(["run", "config.yaml", "--single-process", "--address", "auto"]) == 2
    assert "--single-process runs no Ray" in capsys.readouterr().err


def test_a_bad_config_is_an_error_not_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [{id: x, source: nowhere, max_model_len: -1}]\n")
    assert cli_main.main(["run", str(bad), "--single-process"]) == 2
    assert str(bad) in capsys.readouterr().err


class Engines:
    """What the server needs of its engine client: health, readiness probes, shutdown."""

    def __init__(self, dies_after: int | None = None):
        self.checks, self.dies_after, self.stopped, self.loops = 0, dies_after, False, []

    async def check_health(self) -> None:
        self.checks += 1
        if self.dies_after is not None and self.checks > self.dies_after:
            raise RuntimeError("EngineCore died")

    async def probe(self, key: str) -> None:  # /health asks every engine
        self.loops.append(type(asyncio.get_running_loop()))

    def shutdown(self) -> None:
        self.stopped = True


def _settings(port: int, tmp_path: Path) -> AppSettings:
    data = AppSettings.from_yaml(ROOT / "config.yaml").model_dump()
    data["ingress"]["listen"] = {"host": "127.0.0.1", "port": port, "drain_s": 1}
    data["ingress"]["response_store_path"] = str(tmp_path / "r.sqlite3")
    return AppSettings.model_validate(data)


@pytest.fixture
def started(monkeypatch):
    from serve_app.engine.local_client import LocalEngineClient

    made = {}

    def start(cls, models, **kw):
        made["engines"] = Engines(made.get("dies_after"))
        made["kw"] = kw
        return made["engines"]

    monkeypatch.setattr(LocalEngineClient, "start", classmethod(start))
    return made


def test_it_serves_until_sigint_then_stops_the_engines(started, tmp_path, monkeypatch):
    """`run`, as the command calls it: on uvloop (as Serve's replicas and vLLM's server), the port served until a
    SIGINT, status 0, the engines stopped."""
    import threading

    import uvloop

    port = free_port()
    answers = []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # restored after the test

    def client() -> None:
        while True:
            try:
                answers.append(httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code)
                break
            except httpx.ConnectError:
                time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # the server's handler, not KeyboardInterrupt

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    rc = single_process.run(_settings(port, tmp_path))
    thread.join(5)
    assert answers == [200] and rc == 0
    engines = started["engines"]
    assert engines.stopped and engines.loops and all(issubclass(t, uvloop.Loop) for t in engines.loops)
    assert started["kw"]["replica_id"] == "single-process"
    assert started["kw"]["stat_loggers"] == [LocalEngineStatLogger]  # vLLM's metrics here, not through Ray
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the runner put it back
    assert os.environ["OMP_NUM_THREADS"] == "1"  # set before the engines start, as Ray sets it for its workers


def test_a_dead_engine_stops_it_with_status_1(started, tmp_path):
    started["dies_after"] = 2
    rc = asyncio.run(single_process.serve(_settings(free_port(), tmp_path), health_period_s=0.02))
    assert rc == 1
    assert started["engines"].checks == 3 and started["engines"].stopped


def test_a_sigterm_while_the_engines_start_stops_them(monkeypatch, tmp_path):
    """A supervisor's stop during start-up unwinds through the engine start (which stops what it started) instead
    of ending the process at once with the engines' processes left running; the handler is restored after."""
    from serve_app.engine.local_client import LocalEngineClient

    cleaned = []

    def start(cls, models, **kw):
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while an engine is still starting
            time.sleep(5)
            raise AssertionError("SIGTERM did not interrupt the start")
        except BaseException:
            cleaned.append(True)  # LocalEngineClient.start stops the engines started so far here
            raise

    monkeypatch.setattr(LocalEngineClient, "start", classmethod(start))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        single_process.run(_settings(free_port(), tmp_path))
    assert stopped.value.code == 128 + signal.SIGTERM and cleaned == [True]
    assert signal.getsignal(signal.SIGTERM) is before
