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


def test_engine_restarts_are_refused_where_serve_replaces_the_engines():
    with pytest.raises(ValidationError) as e:
        AppSettings.model_validate({"models": [MODEL], "engine_restarts": {"limit": 1}})
    assert "engine_restarts has no effect" in str(e.value)
    inproc = AppSettings.model_validate({"models": [MODEL], "engine_placement": "ingress",
                                         "engine_restarts": {"limit": 1, "window_s": 60}})
    assert (inproc.engine_restarts.limit, inproc.engine_restarts.window_s) == (1, 60)
    assert AppSettings.model_validate({"models": [MODEL]}).engine_restarts.limit == 3


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


def test_the_front_doors_router_reads_the_store_the_ingress_uses(monkeypatch):
    """With `router.front_door` the Router renders Responses continuations from the ingress's store: the one
    ResponseStore deployment both are bound to (Serve builds one bound object once), or, when each ingress replica
    opens the database itself, none (the Router opens it too: front_door_deployment.history_reader)."""
    import ray.serve._private.build_app as serve_build

    from serve_app.app import build_app

    monkeypatch.setattr(serve_build, "RAY_SERVE_ENABLE_HA_PROXY", True)
    base = {"models": [MODEL], "engine_placement": "ingress", "router": {"front_door": True},
            "ingress": {"direct_ingress": True}}
    app = build_app(base)
    ingress, router = app._bound_deployment, app._ingress_request_router._bound_deployment
    assert router.name == "Router"
    store = ingress.init_args[4]
    assert store._bound_deployment.name == "ResponseStore" and router.init_args[3] is store
    built = serve_build.build_app(app, name="t")
    assert sorted(d.name for d in built.deployments) == ["Ingress", "ResponseStore"]
    assert built.ingress_request_router_deployment.name == "Router"

    local = build_app({**base, "ingress": {"direct_ingress": True, "response_store_placement": "ingress"}})
    assert local._bound_deployment.init_args[4] is None and local._ingress_request_router._bound_deployment.init_args[3] is None


class StandIn:
    """VLLMEngine's interface, recording what was asked of it."""

    def __init__(self, chunks=(), invalid: bool = False, fail_start: bool = False, env: dict | None = None):
        self.block_size, self.reasoning_gate, self.dead = 128, True, False
        self.chunks, self.invalid, self.fail_start = list(chunks), invalid, fail_start
        self.validated, self.closed, self.stopped = [], False, False
        self.started_with: bool | None = None
        self.env = env or {}
        self.engine = None  # the AsyncLLM, once started

    def environment(self) -> dict:
        return self.env

    def start(self, cache_envs: bool = True, watched: bool = True) -> None:
        if self.fail_start:
            raise RuntimeError("no memory")
        self.started_with = cache_envs
        self.engine = object()

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


class Guard:
    """reaper.Guard without its watcher process (which would watch this test process's children)."""

    armed: list = []

    def __init__(self, existing=()):
        pass

    def arm(self, pids):
        watcher = object()
        Guard.armed.append(watcher)
        return watcher


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

    from serve_app.engine import reaper

    frozen = []
    monkeypatch.setattr(reaper, "Guard", Guard)
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


def test_engines_of_one_environment_start_together_and_of_different_ones_one_after_another(monkeypatch):
    """A start is mostly vLLM's processes spawning and importing, a core each: engines that set the same
    environment start at once (here they meet at a barrier, which breaks if they start one after another); an
    engine whose environment differs starts after them, since its engine core takes its settings from this
    process's environment as it spawns. One reaper watches each group's new processes."""
    import threading

    from serve_app.engine import reaper
    from serve_app.engine.vllm_engine import start_engines

    events: list[tuple[str, str]] = []
    together = threading.Barrier(2, timeout=30)

    class Starting(StandIn):
        def __init__(self, name: str, env: dict, meet: bool):
            super().__init__(env=env)
            self.name, self.meet = name, meet

        def start(self, cache_envs: bool = True, watched: bool = True) -> None:
            events.append(("start", self.name))
            if self.meet:
                together.wait()
            super().start(cache_envs, watched)
            self.watched = watched
            events.append(("end", self.name))

    Guard.armed.clear()
    monkeypatch.setattr(reaper, "Guard", Guard)
    a, b = Starting("a", {"X": "1"}, True), Starting("b", {"X": "1"}, True)
    gpu = Starting("gpu", {"X": "2"}, False)
    start_engines([a, gpu, b])
    assert events.index(("start", "gpu")) > max(events.index(("end", "a")), events.index(("end", "b")))
    assert a.started_with is b.started_with is gpu.started_with is False  # vLLM's settings left unfrozen
    assert a.watched is b.watched is False and a._reaper is b._reaper is Guard.armed[0]  # one watcher for both
    assert gpu.watched is True and len(Guard.armed) == 1  # alone, it starts (and is watched) as before

    # One of a group fails: the error is raised once every start of it has ended, and the engines that did
    # start are stopped.
    ok, bad = StandIn(env={"X": "1"}), StandIn(env={"X": "1"}, fail_start=True)
    with pytest.raises(RuntimeError, match="no memory"):
        start_engines([ok, bad])
    assert ok.stopped and not bad.stopped


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


# -- a dead engine replaced in place ------------------------------------------------------------------------------


class Replacer:
    """`restart` for LocalEngineClient: stops the dead engine and hands back a new StandIn, once `go` is set (so a
    test can look at the client while the replacement is under way)."""

    def __init__(self, fail: bool = False, ports: tuple[int, int] | None = None):
        self.go, self.fail, self.made, self.calls, self.ports = threading.Event(), fail, [], [], ports

    def __call__(self, key, dead):
        self.calls.append(key)
        dead.shutdown()
        assert self.go.wait(20)
        if self.fail:
            raise RuntimeError("no memory for the new engine")
        self.made.append(StandIn([EngineChunk("new", [7], finish_reason="stop")]))
        if self.ports:  # a replacement publishes its KV events on ports of its own
            self.made[-1].kv_events_port, self.made[-1].kv_replay_port = self.ports
        return self.made[-1]


REQ = EngineRequest(request_id="q", prompt_token_ids=[1], max_tokens=2)


async def _until(predicate, timeout_s: float = 20.0):
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def _restarts(engine: str, outcome: str) -> float:
    from serve_app import metrics

    return metrics.REGISTRY.get_sample_value(metrics.PREFIX + "engine_restarts_total",
                                             {"engine": engine, "outcome": outcome}) or 0.0


def test_a_dead_engine_is_replaced_in_place_while_the_other_serves_on():
    from serve_app.engine.local_client import EngineRestarting

    a, b = StandIn(), StandIn([EngineChunk("b", [2], finish_reason="stop")])
    replacer = Replacer()
    client = LocalEngineClient({"A": a, "B": b}, restart=replacer)

    async def scenario():
        a.dead = True
        await client.check_health()  # found dead: its replacement starts, the process stays healthy
        with pytest.raises(EngineRestarting) as refused:
            await client.open("A", REQ)
        err = refused.value
        assert (err.kind, err.status, err.code, err.retry_after) == ("overloaded", 503, "engine_restarting", 5.0)
        stream = await client.open("B", REQ)  # the other engine serves meanwhile
        assert [c.text async for c in stream] == ["b"]
        assert await client.num_unfinished() == 1  # only B is asked; A's engine is gone
        await client.check_health()
        replacer.go.set()
        await _until(lambda: "A" not in client._restarting)
        stream = await client.open("A", REQ)
        assert [c.text async for c in stream] == ["new"]
        await client.check_health()

    replaced_before = _restarts("A", "replaced")
    run(scenario())
    assert replacer.calls == ["A"] and a.stopped and client._engines["A"] is replacer.made[0]
    assert _restarts("A", "replaced") == replaced_before + 1


def test_a_request_that_finds_its_engine_dead_starts_the_replacement_at_once():
    from serve_app.engine.local_client import EngineRestarting

    a = StandIn()
    replacer = Replacer()
    replacer.go.set()
    client = LocalEngineClient({"A": a}, restart=replacer)

    async def scenario():
        a.dead = True
        with pytest.raises(EngineRestarting):
            await client.choose("A", RouteRequest(request_id="x", block_hashes=[], num_prompt_tokens=3))
        await _until(lambda: "A" not in client._restarting)
        return [c.text async for c in await client.open("A", REQ)]

    assert run(scenario()) == ["new"] and replacer.calls == ["A"]


def test_an_engine_that_keeps_dying_or_cannot_be_replaced_fails_the_health_check():
    from serve_app.settings import EngineRestarts

    async def die_and_replace(client, replacer, times):
        for _ in range(times):
            client._engines["A"].dead = True
            await client.check_health()
            await _until(lambda: "A" not in client._restarting)

    replacer = Replacer()
    replacer.go.set()
    client = LocalEngineClient({"A": StandIn()}, restart=replacer, restarts=EngineRestarts(limit=2, window_s=600))

    async def past_the_limit():
        await die_and_replace(client, replacer, 2)
        client._engines["A"].dead = True
        with pytest.raises(RuntimeError, match="EngineCore"):  # a third death within the window: replace the process
            await client.check_health()

    given_up, failed = _restarts("A", "given_up"), _restarts("A", "failed")
    run(past_the_limit())
    assert replacer.calls == ["A", "A"] and _restarts("A", "given_up") == given_up + 1

    failing = Replacer(fail=True)
    failing.go.set()
    client = LocalEngineClient({"A": StandIn(), "B": StandIn()}, restart=failing)

    async def replacement_fails():
        client._engines["A"].dead = True
        await client.check_health()
        await _until(lambda: "A" not in client._restarting)
        with pytest.raises(RuntimeError, match="no memory for the new engine"):
            await client.check_health()

    run(replacement_fails())
    assert _restarts("A", "failed") == failed + 1

    never = LocalEngineClient({"A": StandIn()}, restart=replacer, restarts=EngineRestarts(limit=0))
    never._engines["A"].dead = True
    with pytest.raises(RuntimeError, match="EngineCore"):
        run(never.check_health())


def test_shutdown_waits_for_a_replacement_under_way_and_stops_it_too():
    a, b = StandIn(), StandIn()
    replacer = Replacer()
    client = LocalEngineClient({"A": a, "B": b}, restart=replacer)
    loop = asyncio.new_event_loop()

    async def begin():
        a.dead = True
        await client.check_health()
        await _until(lambda: replacer.calls == ["A"])

    loop.run_until_complete(begin())
    stopping = threading.Thread(target=client.shutdown)
    stopping.start()
    stopping.join(0.3)
    assert stopping.is_alive()  # waiting for the engine being started
    replacer.go.set()
    stopping.join(20)
    assert not stopping.is_alive() and b.stopped and replacer.made[0].stopped
    loop.close()


def test_the_front_door_router_learns_the_replacement_s_endpoints():
    class Router:
        def __init__(self):
            self.registered = []

        class _Remote:
            def __init__(self, fn):
                self.remote = fn

        @property
        def register_replica(self):
            async def remote(key, replica, events, replay, block, refresh=False, running=None):
                self.registered.append((key, events))
            return self._Remote(remote)

    a = StandIn()
    a.kv_events_port, a.kv_replay_port = 5001, 5002
    replacer = Replacer(ports=(6001, 6002))
    replacer.go.set()
    router = Router()
    client = LocalEngineClient({"A": a}, restart=replacer)

    async def scenario():
        client.report_to(router, "10.0.0.1")
        await _until(lambda: router.registered)
        a.dead = True
        await client.check_health()
        await _until(lambda: ("A", "tcp://10.0.0.1:6001") in router.registered)
        client.shutdown()

    run(scenario())
    assert router.registered[0] == ("A", "tcp://10.0.0.1:5001")


def test_start_replaces_a_dead_engine_with_one_built_as_the_first_and_vllm_s_settings_thawed_for_it(monkeypatch):
    made: list[StandIn] = []
    envs: list[str] = []

    def fake_engine(model, path, **kw):
        e = StandIn()
        e.model, e.kw = model, kw
        made.append(e)
        return e

    import serve_app.engine.provision as provision
    import serve_app.engine.vllm_engine as vllm_engine

    from serve_app.engine import reaper

    monkeypatch.setattr(reaper, "Guard", Guard)
    monkeypatch.setattr(vllm_engine, "VLLMEngine", fake_engine)
    monkeypatch.setattr(vllm_engine, "freeze_vllm_envs", lambda: envs.append("frozen"))
    monkeypatch.setattr(vllm_engine, "thaw_vllm_envs", lambda: envs.append("thawed"))
    monkeypatch.setattr(provision, "ensure_model", lambda source, cache: f"/models/{source}")
    settings = AppSettings.model_validate({"models": [MODEL, {**MODEL, "id": "m3", "max_model_len": 4096}]})
    client = LocalEngineClient.start(settings.models, forced_scripts=True, model_cache_dir=None, kv_events=True)
    key = engine_key(settings.models[1])
    old = client._engines[key]
    replacement = client._restart(key, old)
    assert old.stopped and replacement is made[-1] and len(made) == 3
    assert replacement.model is settings.models[1] and replacement.kw == old.kw and replacement.started_with is False
    assert envs == ["frozen", "thawed", "frozen"]
