"""The engines' Serve request router (runs in each ingress): honours the Router's target, and reports Serve's
live replicas to the Router, so a dead one leaves its index. Ray's own RequestRouter base, no cluster."""

import asyncio

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
from ray.serve.request_router import PendingRequest

from serve_app.app import _engine_options
from serve_app.engine.types import EngineRequest
from serve_app.routing import serve_router
from serve_app.routing.serve_router import TargetReplicaRouter
from serve_app.settings import ModelConfig

DEP = DeploymentID(name="Engine-x", app_name="app1")


class Replica:
    """What the base class reads of a RunningReplica."""

    def __init__(self, uid):
        self.replica_id = ReplicaID(uid, DEP)
        self.multiplexed_model_ids = set()
        self.node_id = "n"
        self.availability_zone = None

    async def get_queue_len(self, deadline_s):
        return 0


class RouterHandle:
    def __init__(self, calls):
        self.calls = calls

    @property
    def sync_replicas(self):
        return self

    def remote(self, key, ids):
        self.calls.append((key, sorted(ids)))


class InReplica(TargetReplicaRouter):
    """As in an ingress replica, with the Router's handle recorded. Overridden on the class, not patched into the
    module: after the integration tests in one pytest process, module-level patches stopped reaching the router's
    methods (seen twice in CI, never alone)."""

    handles: list

    def _reports(self) -> bool:
        return True

    def _handle(self):
        self.handles.append(("Router", self._router_app))
        return RouterHandle(self.calls)


def _router(monkeypatch, calls):
    handles = []
    r = InReplica(DEP, DeploymentHandleSource.REPLICA)
    r.handles, r.calls = handles, calls
    r.initialize_state(**_engine_options(ModelConfig(id="m"), "Engine-x")["request_router_config"].request_router_kwargs)
    return r, handles


def _pending(target):
    req = EngineRequest(request_id="1", prompt_token_ids=[1], max_tokens=1, target_replica=target)
    return PendingRequest(args=[req], kwargs={}, metadata=None)


def test_live_replicas_and_dead_actors_are_reported_to_the_router(monkeypatch):
    calls = []

    async def run():
        r, handles = _router(monkeypatch, calls)
        a, b = Replica("a"), Replica("b")
        r.update_replicas([a, b])
        r.on_replica_actor_died(b.replica_id)  # a call found b's actor dead before Serve's controller did
        r.update_replicas([a, Replica("c")])  # a replica joins
        return r, handles

    r, handles = asyncio.run(run())
    state = dict(router_app=r._router_app, engine_keys=r._engine_keys, handle=r._router_handle,
                 in_replica=serve_router._in_replica(), same_module=r._sync.__globals__ is vars(serve_router))
    assert handles == [("Router", "app1")], state  # the Router of the engines' own app
    assert calls == [("Engine-x", ["a", "b"]), ("Engine-x", ["a"]), ("Engine-x", ["a", "c"])]


def test_the_target_is_honoured_and_a_gone_target_falls_back_to_all(monkeypatch):
    async def run():
        r, _ = _router(monkeypatch, [])
        a, b = Replica("a"), Replica("b")
        r.update_replicas([a, b])

        return (await r.choose_replicas([a, b], _pending("b")), await r.choose_replicas([a, b], _pending("gone")),
                a, b)

    to_b, fallback, a, b = asyncio.run(run())
    assert to_b == [[b]] and fallback == [[a, b]]


def test_a_driver_handle_never_reports(monkeypatch):
    """Outside a replica (a test's or a script's engine handle) reporting would create the Router's handle on the
    driver's shared router thread and deadlock it; it is skipped."""
    calls = []
    r, handles = _router(monkeypatch, calls)
    monkeypatch.setattr(r, "_reports", TargetReplicaRouter._reports.__get__(r))  # the real check: a driver here
    r._sync(["a", "b"])
    assert handles == [] and calls == []


def test_an_unreachable_replica_is_passed_over_while_another_remains(monkeypatch):
    """A node lost: a call finds replica b's actor unreachable before Serve's controller drops it. b looks the
    least loaded (its requests just failed), so Serve's own choice would send the retry straight back; it is passed
    over for a while, even as the Router's target, unless it is the only candidate left."""

    async def run():
        r, _ = _router(monkeypatch, [])
        a, b = Replica("a"), Replica("b")
        r.update_replicas([a, b])

        r.on_replica_actor_unavailable(b.replica_id)
        out = {"any": await r.choose_replicas([a, b], _pending(None)),
               "target b": await r.choose_replicas([a, b], _pending("b")),
               "only b": await r.choose_replicas([b], _pending(None))}
        clock = [serve_router.time.monotonic() + serve_router.SUSPECT_S + 1]
        monkeypatch.setattr(serve_router.time, "monotonic", lambda: clock[0])
        out["later"] = await r.choose_replicas([a, b], _pending(None))
        r.on_replica_actor_unavailable(b.replica_id)
        r.update_replicas([a])  # Serve dropped it: forgotten, and a replacement with another id is not affected
        out["dropped"] = dict(r._suspects)
        return out, a, b

    out, a, b = asyncio.run(run())
    assert out["any"] == [[a]] and out["target b"] == [[a]]
    assert out["only b"] == [[b]]  # nothing else: Serve's own retries decide
    assert out["later"] == [[a, b]]  # the suspicion expires: a replica that was only briefly unreachable returns
    assert out["dropped"] == {}


def test_an_ingress_with_every_engine_reports_its_replicas_under_each_engine_key(monkeypatch):
    """The front door's Router (routing/front_door_deployment.py) routes to Ingress replicas that each run every
    engine of the app: each engine's routing set is the live ingress replicas."""
    calls = []

    async def run():
        r = InReplica(DEP, DeploymentHandleSource.REPLICA)
        r.handles, r.calls = [], calls
        r.initialize_state(engine_keys=["Engine-a", "Engine-b"])
        r.update_replicas([Replica("x"), Replica("y")])

    asyncio.run(run())
    assert calls == [("Engine-a", ["x", "y"]), ("Engine-b", ["x", "y"])]

