"""Routing inside the ingress (`router.placement: ingress`): the ingress's own RoutingTable follows the Router
deployment's snapshot (live replicas, registrations, policy), subscribes to the engines' KV events itself, and
decides with function calls. The control plane here is the Router deployment's own RoutingTable, without Ray."""

import asyncio

import pytest
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

from serve_app.ingress.clients import ServeEngineClient
from serve_app.routing.hashing import block_hashes
from serve_app.routing.index import EVENTS
from serve_app.routing.local import LocalRouter
from serve_app.routing.table import RoutingTable
from serve_app.routing.types import RouteRequest
from serve_app.settings import RouterConfig
from tests.support.aio import free_port, until

BS = 4
TOKENS = list(range(100, 124))
OURS = block_hashes(TOKENS, BS)
KEY = "Engine-x"


class Remote:
    """`handle.method.remote(...)` over a plain object: what a Serve handle call looks like to the caller."""

    def __init__(self, target, fail: bool = False):
        self.target = target
        self.fail = fail
        self.calls: list[str] = []

    def options(self, **_):
        return self

    def __getattr__(self, name):
        method = getattr(self.target, name)
        outer = self

        class _M:
            @staticmethod
            def remote(*args):
                outer.calls.append(name)

                async def call():
                    if outer.fail:
                        raise ConnectionError("Router unavailable")
                    return method(*args)

                return call()

        return _M


def control_plane(policy="kv", replicas=()) -> RoutingTable:
    """The Router deployment's table with placement `ingress`: registrations and membership, no feeds; `replicas`
    registered without KV endpoints and running."""
    cp = RoutingTable(RouterConfig(policy=policy, placement="ingress"), kv_events=False)
    for rid in replicas:
        cp.register_replica(KEY, rid, None, None, BS)
    if replicas:
        cp.sync_replicas(KEY, list(replicas))
    return cp


def test_snapshot_lists_live_replicas_with_their_registrations_and_the_policy():
    cp = control_plane()
    cp.register_replica(KEY, "a", None, None, BS)
    cp.register_replica(KEY, "b", None, None, BS)
    cp.sync_replicas(KEY, ["a", "b", "c"])  # c runs but has not registered yet
    snap = cp.snapshot(KEY)
    assert snap["policy"] == "kv"
    assert sorted(snap["live"]) == ["a", "b", "c"]
    assert snap["registrations"] == {"a": [None, None, BS], "b": [None, None, BS]}
    cp.sync_replicas(KEY, ["b"])
    assert cp.snapshot(KEY)["live"] == ["b"] and list(cp.snapshot(KEY)["registrations"]) == ["b"]


def test_a_follower_takes_membership_and_policy_and_keeps_its_own_reservations():
    cp = control_plane("kv", ["a", "b"])
    local = RoutingTable(RouterConfig(policy="kv"))
    local.follow(KEY, cp.snapshot(KEY))
    assert sorted(local.cores[KEY].loads) == ["a", "b"]
    assert local.cores[KEY].block_size == BS

    d = local.choose(KEY, RouteRequest("q1", OURS, len(TOKENS)))
    assert d is not None and d.replica_id in ("a", "b")
    assert local.metrics()[KEY]["inflight"] == 1 and cp.metrics()[KEY]["inflight"] == 0  # decided locally

    cp.set_policy(KEY, "round_robin")
    local.follow(KEY, cp.snapshot(KEY))
    assert local.cores[KEY].policy == "round_robin"
    assert local.metrics()[KEY]["inflight"] == 1  # a policy switch keeps what is in flight

    cp.sync_replicas(KEY, ["a" if d.replica_id == "b" else "b"])  # the chosen replica died
    local.follow(KEY, cp.snapshot(KEY))
    assert list(local.cores[KEY].loads) == cp.snapshot(KEY)["live"]
    assert local.metrics()[KEY]["inflight"] == 0  # its reservation went with it
    local.release(KEY, "q1", 3)  # the stream's end, after the replica left: nothing to free, no error


def test_a_replica_that_restarts_with_new_endpoints_gets_a_new_feed():
    cp = control_plane(replicas=["a"])
    local = RoutingTable(RouterConfig())
    local.follow(KEY, cp.snapshot(KEY))
    local.cores[KEY].blocks_stored("a", OURS[:2])
    local.follow(KEY, cp.snapshot(KEY))  # the same registration: the index is kept
    assert set(local.cores[KEY].index.replicas["a"].blocks) == set(OURS[:2])
    cp.register_replica(KEY, "a", None, "tcp://127.0.0.1:1", BS)  # registered again, other endpoints
    local.follow(KEY, cp.snapshot(KEY))
    assert set(local.cores[KEY].index.replicas["a"].blocks) == set()  # starts from what its events say


def test_drop_replica_stops_routing_there_before_the_next_snapshot():
    cp = control_plane("least_loaded", ["a", "b"])
    local = RoutingTable(RouterConfig(policy="least_loaded"))
    local.follow(KEY, cp.snapshot(KEY))
    local.drop_replica(KEY, "a")
    assert [local.choose(KEY, RouteRequest(f"q{i}", OURS, len(TOKENS))).replica_id for i in range(4)] == ["b"] * 4


async def test_local_router_decides_without_calling_the_router_and_survives_its_loss():
    cp = control_plane("kv", ["a"])
    handle = Remote(cp)
    local = LocalRouter(RouterConfig(policy="kv", sync_interval_s=0.05), handle, [KEY])
    client = ServeEngineClient({}, handle, local=local)
    try:
        d = await client.choose(KEY, RouteRequest("q1", OURS, len(TOKENS)))
        assert d is not None and d.replica_id == "a"
        client.prefilled(KEY, "q1", 0)
        client.release(KEY, "q1", 5)
        assert set(handle.calls) == {"snapshot"}  # no choose / mark_prefilled / release round trips
        assert local.metrics()[KEY]["inflight"] == 0 and local.metrics()[KEY]["decisions"] == 1

        handle.fail = True  # the Router replica is gone: routing goes on from the last membership
        syncs = local.syncs
        await until(lambda: local.syncs > syncs + 1)
        assert local.sync_failures > 0
        d = await client.choose(KEY, RouteRequest("q2", OURS, len(TOKENS)))
        assert d is not None and d.replica_id == "a"

        handle.fail = False
        cp.register_replica(KEY, "b", None, None, BS)
        cp.sync_replicas(KEY, ["a", "b"])
        await until(lambda: sorted(local.table.cores[KEY].loads) == ["a", "b"])
    finally:
        await local.close()


async def test_ready_gives_up_after_its_timeout_when_the_router_never_answers():
    class Silent:
        class snapshot:
            @staticmethod
            def remote(key):
                return asyncio.sleep(3600)

    local = LocalRouter(RouterConfig(), Silent(), [KEY])
    try:
        assert await local.ready(0.05) is False
        assert local.choose(KEY, RouteRequest("q", OURS, len(TOKENS))) is None  # Serve's least-loaded choice
    finally:
        await local.close()


@pytest.mark.asyncio
async def test_the_ingress_table_indexes_an_engines_kv_events_from_the_routers_registration():
    port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}")
    cp = control_plane("kv")
    cp.register_replica(KEY, "a", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", BS)
    cp.register_replica(KEY, "b", None, None, BS)
    cp.sync_replicas(KEY, ["a", "b"])
    local = LocalRouter(RouterConfig(policy="kv", sync_interval_s=0.05), Remote(cp), [KEY])
    try:
        pub.publish(KVEventBatch(ts=0.0, events=[BlockStored(
            block_hashes=[b"h0", b"h1", b"h2"], parent_block_hash=None, token_ids=TOKENS[:12], block_size=BS,
            lora_id=None, medium="GPU", lora_name=None)]))
        assert await local.ready(5.0)
        core = local.table.cores[KEY]
        await until(lambda: set(core.index.replicas["a"].blocks) == set(OURS[:3]))
        assert core.index.replicas["a"].mode == EVENTS
        assert not cp.cores[KEY].index.replicas["a"].blocks  # the control plane subscribes to nothing
        d = local.choose(KEY, RouteRequest("q", OURS, len(TOKENS)))
        assert d.replica_id == "a" and d.cached_blocks == 3
    finally:
        await local.close()
        pub.shutdown()


def test_the_router_deployment_subscribes_to_kv_events_only_where_it_decides():
    from serve_app.routing.deployment import Router

    router_class = Router.func_or_class  # the class under Serve's decorator: no cluster needed
    assert router_class(RouterConfig(placement="ingress").model_dump()).table.kv_events is False
    assert router_class(RouterConfig(placement="deployment").model_dump()).table.kv_events is True
    assert router_class(RouterConfig(placement="deployment", kv_events=False).model_dump()).table.kv_events is False


async def test_a_restarted_router_that_knows_no_replicas_does_not_empty_the_ingress_table():
    cp = control_plane("kv", ["a"])
    handle = Remote(cp)
    local = LocalRouter(RouterConfig(policy="kv", sync_interval_s=0.05), handle, [KEY])
    try:
        assert await local.ready(5.0)
        handle.target = control_plane("kv")  # the Router replica restarted: no registrations, no live set yet
        syncs = local.syncs
        await until(lambda: local.syncs > syncs + 2)
        assert list(local.table.cores[KEY].loads) == ["a"]
        assert local.choose(KEY, RouteRequest("q", OURS, len(TOKENS))).replica_id == "a"
    finally:
        await local.close()


def test_an_engines_repeated_registration_changes_nothing_but_teaches_a_restarted_router():
    cp = control_plane("kv", ["a", "b"])
    cp.cores[KEY].blocks_stored("a", OURS[:2])
    cp.register_replica(KEY, "a", None, None, BS, refresh=True)
    assert set(cp.cores[KEY].index.replicas["a"].blocks) == set(OURS[:2])  # the index is kept
    cp.sync_replicas(KEY, ["a"])  # b left Serve's running set (draining) but still repeats its registration
    cp.register_replica(KEY, "b", None, None, BS, refresh=True)
    assert cp.snapshot(KEY)["live"] == ["a"]

    restarted = control_plane("kv")  # a new Router replica: an empty table
    restarted.register_replica(KEY, "a", None, None, BS, refresh=True)
    assert restarted.snapshot(KEY)["live"] == ["a"] and list(restarted.snapshot(KEY)["registrations"]) == ["a"]
