"""`engine_placement: ingress`: the settings, the app it builds and the in-process engine client (no Ray, no vLLM:
the engines here are stand-ins for VLLMEngine's interface; tests/integration/test_engine_in_ingress.py runs the
real one)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from pydantic import ValidationError

from serve_app.engine.local_client import POLICY, LocalEngineClient
from serve_app.engine.types import EngineChunk, EngineRequest
from serve_app.routing.types import RouteRequest
from serve_app.service import engine_key
from serve_app.settings import AppSettings

MODEL = {"id": "m", "source": "org/some-model", "engine_env": {"VLLM_CPU_KVCACHE_SPACE": "3"}}


def test_engines_stay_in_their_deployment_by_default():
    assert AppSettings.model_validate({"models": [MODEL]}).engine_placement == "deployment"


def test_engine_deployment_options_are_refused_when_the_ingress_runs_the_engines():
    with pytest.raises(ValidationError) as e:
        AppSettings.model_validate({"models": [{**MODEL, "deployment": {"num_replicas": 2}}],
                                    "engine_placement": "ingress"})
    assert "models[0].deployment" in str(e.value) and "ingress.deployment" in str(e.value)


def test_the_app_is_the_ingress_alone_with_the_engines_environment():
    from serve_app.app import build_app

    app = build_app({"models": [MODEL], "engine_placement": "ingress",
                     "ingress": {"direct_ingress": True, "deployment": {"num_replicas": 2}}})
    dep = app._bound_deployment
    assert dep.name == "Ingress"
    settings, _secret, engines, router = dep.init_args[:4]
    assert engines == {} and router is None and settings["engine_placement"] == "ingress"
    env = dep.ray_actor_options["runtime_env"]["env_vars"]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert dep.num_replicas == 2
    # With the Engine deployment the same settings bind a Router and an Engine beside the ingress.
    split = build_app({"models": [MODEL]})._bound_deployment
    assert split.init_args[2] and split.init_args[3] is not None


class StandIn:
    """VLLMEngine's interface, recording what was asked of it."""

    def __init__(self, chunks=(), invalid: bool = False, fail_start: bool = False):
        self.block_size, self.reasoning_gate, self.dead = 128, True, False
        self.chunks, self.invalid, self.fail_start = list(chunks), invalid, fail_start
        self.validated, self.closed, self.stopped = [], False, False
        self.started_with: bool | None = None

    def start(self, cache_envs: bool = True) -> None:
        if self.fail_start:
            raise RuntimeError("no memory")
        self.started_with = cache_envs

    def validate(self, req):
        self.validated.append(req.request_id)
        if self.invalid:
            raise ValueError("schema")

    async def generate(self, req):
        try:
            for c in self.chunks:
                yield c
        finally:
            self.closed = True

    async def num_unfinished(self) -> int:
        return len(self.chunks)

    async def check_health(self) -> None:
        if self.dead:
            raise RuntimeError("EngineCore encountered an issue")  # what AsyncLLM raises (EngineDeadError)

    def shutdown(self) -> None:
        self.stopped = True


def run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


def test_choose_names_this_process_and_refuses_an_engine_it_lacks():
    client = LocalEngineClient({"E": StandIn()}, replica_id="r1")
    d = run(client.choose("E", RouteRequest(request_id="a", block_hashes=[], num_prompt_tokens=3)))
    assert (d.replica_id, d.policy, d.cached_blocks) == ("r1", POLICY, 0)
    with pytest.raises(RuntimeError, match="no engine X"):
        run(client.choose("X", RouteRequest(request_id="a", block_hashes=[], num_prompt_tokens=3)))
    assert run(client.block_size("E")) == 128 and run(client.reasoning_gate("E")) is True


def test_health_fails_when_any_engine_in_the_process_is_dead():
    a, b = StandIn(), StandIn()
    client = LocalEngineClient({"A": a, "B": b})
    run(client.check_health())
    b.dead = True
    with pytest.raises(RuntimeError, match="EngineCore"):
        run(client.check_health())


def test_open_validates_before_the_stream_and_closing_it_closes_the_engines():
    chunks = [EngineChunk("a", [1]), EngineChunk("b", [2], finish_reason="stop")]
    engine = StandIn(chunks)
    client = LocalEngineClient({"E": engine})

    async def first_then_close():
        stream = await client.open("E", EngineRequest(request_id="q", prompt_token_ids=[1], max_tokens=2))
        assert engine.validated == ["q"]
        got = await stream.__anext__()
        await stream.aclose()  # what the service does when the client goes away
        return got

    assert run(first_then_close()).text == "a" and engine.closed
    bad = LocalEngineClient({"E": StandIn(chunks, invalid=True)})
    with pytest.raises(ValueError):
        run(bad.open("E", EngineRequest(request_id="q", prompt_token_ids=[1], max_tokens=2)))


def test_start_builds_one_engine_per_key_and_stops_them_all_if_one_fails(monkeypatch):
    made: list[StandIn] = []
    failing = {"n": None}

    def fake_engine(model, path, **kw):
        e = StandIn(fail_start=len(made) == failing["n"])
        made.append(e)
        return e

    import serve_app.engine.provision as provision
    import serve_app.engine.vllm_engine as vllm_engine

    frozen = []
    monkeypatch.setattr(vllm_engine, "VLLMEngine", fake_engine)
    monkeypatch.setattr(vllm_engine, "freeze_vllm_envs", lambda: frozen.append(True))
    monkeypatch.setattr(provision, "ensure_model", lambda source, cache: f"/models/{source}")
    settings = AppSettings.model_validate({"models": [MODEL, {**MODEL, "id": "m2"},  # same engine key as m
                                                      {**MODEL, "id": "m3", "max_model_len": 4096}]})
    client = LocalEngineClient.start(settings.models, forced_scripts=False, model_cache_dir=None)
    assert len(made) == 2 and set(client._engines) == {engine_key(m) for m in settings.models}
    assert [e.started_with for e in made] == [False, False] and frozen == [True]  # frozen after the last
    assert run(client.num_unfinished()) == 0

    made.clear()
    failing["n"] = 1
    with pytest.raises(RuntimeError, match="no memory"):
        LocalEngineClient.start(settings.models, forced_scripts=False, model_cache_dir=None)
    assert made[0].stopped  # the engine that did start is not left running


def test_local_client_is_the_services_engine_client():
    from serve_app.service import EngineClient

    missing = [n for n in dir(EngineClient) if not n.startswith("_") and not hasattr(LocalEngineClient, n)]
    assert missing == []


def test_shutdown_stops_the_engines_at_once_and_each_despite_another_failing():
    """Each engine's stop waits seconds for vLLM's processes; config.yaml's replica has two engines, and one after
    another those waits added up on every Ctrl-C. The two stops here meet at a barrier: one at a time, the first
    would wait there alone until the barrier broke."""
    meet = threading.Barrier(2, timeout=20)
    stopped = []

    class Stopping(StandIn):
        def __init__(self, name, fails=False):
            super().__init__()
            self.name, self.fails = name, fails

        def shutdown(self):
            meet.wait()
            if self.fails:
                raise RuntimeError("engine core already gone")
            stopped.append(self.name)

    LocalEngineClient({"A": Stopping("A", fails=True), "B": Stopping("B")}).shutdown()
    assert stopped == ["B"] and not meet.broken
