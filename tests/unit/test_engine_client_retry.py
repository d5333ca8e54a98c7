"""The ingress's engine client: a request whose chosen replica died before it started goes to a live one."""

import asyncio

import pytest

from serve_app.engine.delta_channel import DeltaSender
from serve_app.engine.types import EngineChunk, EngineRequest
from serve_app.ingress.clients import ServeEngineClient


class ActorDiedError(Exception):  # named like Ray's: the client classifies errors by name, not by import
    pass


class ActorUnavailableError(Exception):
    pass


SENDER = DeltaSender()  # lives as long as the replica's does: a closed socket drops what it has not sent


class Gen:
    """The Engine deployment's call: the acceptance, then (as the real replica does) the deltas over the delta
    channel to the address the request names, while the call itself ends."""

    def __init__(self, error, chunks, reply_to, lost=None):
        """`error`: the call fails before acceptance; `lost`: the replica dies after sending `chunks`."""
        self.error, self.chunks, self.cancelled, self.reply_to = error, list(chunks), False, reply_to
        self.accepted = False
        self.lost = lost

    async def __anext__(self):
        if self.error is not None:
            raise self.error
        if not self.accepted:
            self.accepted = True
            return EngineChunk(text="", token_ids=[])
        address, key = self.reply_to
        for chunk in self.chunks:
            SENDER.send(address, key, chunk)
        self.chunks = []
        if self.lost is not None:
            await asyncio.sleep(0.05)  # the deltas reach the ingress before the lease's failure does
            raise self.lost
        raise StopAsyncIteration

    def __aiter__(self):
        return self

    def cancel(self):
        self.cancelled = True


class Handle:
    """An Engine deployment handle whose replicas in `dead` fail every call with `error`."""

    def __init__(self, dead=(), error=ActorDiedError):
        self.dead, self.error, self.sent, self.gens = set(dead), error, [], []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, req):
        self.sent.append(req.target_replica)
        err = self.error("gone") if req.target_replica in self.dead else None
        gen = Gen(err, [EngineChunk(text="ok", token_ids=[1], finish_reason="stop")], req.reply_to)
        self.gens.append(gen)
        return gen


async def _texts(client, req):
    return [c.text async for c in await client.open("e", req)]


def test_a_dead_target_is_retried_on_a_live_replica():
    h = Handle(dead={"r-dead"})
    client = ServeEngineClient({"e": h}, None)
    req = EngineRequest(request_id="1", prompt_token_ids=[1, 2], max_tokens=4, target_replica="r-dead")
    assert asyncio.run(_texts(client, req)) == ["ok"]
    assert h.sent == ["r-dead", None] and h.gens[0].cancelled


class FlakyPick(Handle):
    """Serve's own pick (no target) lands on a dead replica the first `misses` times: its controller has not
    dropped it yet."""

    def __init__(self, misses):
        super().__init__()
        self.misses = misses

    def remote(self, req):
        self.dead = {None} if self.misses > 0 else set()
        self.misses -= 1
        return super().remote(req)


@pytest.mark.parametrize("misses", [1, 2, 5])
def test_serves_own_pick_of_a_dead_replica_is_retried_too(misses):
    """However many times Serve picks the dead replica again within the retry time (CI once saw more than two)."""
    h = FlakyPick(misses=misses)
    req = EngineRequest(request_id="1", prompt_token_ids=[1, 2], max_tokens=4)
    assert asyncio.run(_texts(ServeEngineClient({"e": h}, None), req)) == ["ok"]
    assert h.sent == [None] * (misses + 1)


def test_a_replica_gone_every_time_fails_after_the_retry_time():
    h = Handle(dead={None})
    req = EngineRequest(request_id="1", prompt_token_ids=[1, 2], max_tokens=4)
    with pytest.raises(ActorDiedError):
        asyncio.run(_texts(ServeEngineClient({"e": h}, None, gone_retry_s=0.3), req))
    # re-sent while the time lasts (0.05, 0.1, 0.2 s apart), then it gives up with the replica's error
    assert len(h.sent) >= 2 and set(h.sent) == {None} and all(g.cancelled for g in h.gens)


def test_other_failures_are_not_retried():
    h = Handle(dead={"r-dead"}, error=ValueError)
    client = ServeEngineClient({"e": h}, None)
    req = EngineRequest(request_id="1", prompt_token_ids=[1, 2], max_tokens=4, target_replica="r-dead")
    with pytest.raises(ValueError):
        asyncio.run(_texts(client, req))
    assert h.sent == ["r-dead"]


class DyingHandle(Handle):
    """The first call goes to a replica that dies after accepting, having sent `before` chunks."""

    def __init__(self, before):
        super().__init__()
        self.before = before

    def remote(self, req):
        if self.sent:
            return super().remote(req)
        self.sent.append(req.target_replica)
        gen = Gen(None, self.before, req.reply_to, lost=ActorUnavailableError("node lost"))
        self.gens.append(gen)
        return gen


def test_a_replica_that_dies_before_the_first_token_hands_the_request_to_a_live_one():
    h = DyingHandle(before=[])
    req = EngineRequest(request_id="1", prompt_token_ids=[1, 2], max_tokens=4, target_replica="r-dying")
    assert asyncio.run(_texts(ServeEngineClient({"e": h}, None), req)) == ["ok"]
    assert h.sent == ["r-dying", None]


def test_a_replica_that_dies_after_streaming_fails_the_request():
    h = DyingHandle(before=[EngineChunk(text="partial", token_ids=[5])])
    req = EngineRequest(request_id="1", prompt_token_ids=[1, 2], max_tokens=4, target_replica="r-dying")
    seen = []

    async def run():
        async for c in await ServeEngineClient({"e": h}, None).open("e", req):
            seen.append(c.text)

    with pytest.raises(ActorUnavailableError):
        asyncio.run(run())
    assert seen == ["partial"] and h.sent == ["r-dying"]  # the client saw output: no silent second answer


def _local_table(replicas):
    from serve_app.routing.local import LocalRouter
    from serve_app.settings import RouterConfig

    local = LocalRouter(RouterConfig(placement="ingress"), None, ["e"])
    for rid in replicas:
        local.table.register_replica("e", rid, None, None, 16)
    local.table.sync_replicas("e", list(replicas))
    return local


def test_a_replica_that_dies_before_the_first_token_fails_the_request_when_no_other_is_known():
    # The only replica died: waiting for Serve to start a replacement would hold the client's open stream for
    # minutes; the request fails now instead, and nothing is sent again.
    h = DyingHandle(before=[])
    req = EngineRequest(request_id="1", prompt_token_ids=[1, 2], max_tokens=4, target_replica="r-dying")
    client = ServeEngineClient({"e": h}, None, local=_local_table(["r-dying"]))
    with pytest.raises(ActorUnavailableError):
        asyncio.run(_texts(client, req))
    assert h.sent == ["r-dying"] and not client.local.knows_live("e")


def test_the_handover_goes_to_a_replica_the_table_still_lists():
    h = DyingHandle(before=[])
    req = EngineRequest(request_id="1", prompt_token_ids=[1, 2], max_tokens=4, target_replica="r-dying")
    client = ServeEngineClient({"e": h}, None, local=_local_table(["r-dying", "r-live"]))
    assert asyncio.run(_texts(client, req)) == ["ok"]
    assert h.sent == ["r-dying", None]


class NeverAccepts(DyingHandle):
    """After the dying replica, no replica accepts (Serve holds the call until a replacement starts)."""

    def remote(self, req):
        if not self.sent:
            return super().remote(req)
        self.sent.append(req.target_replica)
        gen = Gen(None, [], req.reply_to)

        async def pending():
            await asyncio.sleep(3600)

        gen.__anext__ = pending
        self.gens.append(gen)
        return gen


def test_a_handover_no_replica_accepts_in_time_fails_with_the_replicas_error(monkeypatch):
    from serve_app.ingress import clients

    monkeypatch.setattr(clients, "FAILOVER_ACCEPT_S", 0.2)
    h = NeverAccepts(before=[])
    req = EngineRequest(request_id="1", prompt_token_ids=[1, 2], max_tokens=4, target_replica="r-dying")
    with pytest.raises(ActorUnavailableError):
        asyncio.run(_texts(ServeEngineClient({"e": h}, None), req))
    assert h.sent == ["r-dying", None] and h.gens[1].cancelled  # the waiting call is withdrawn


class _Code:
    def __init__(self, name):
        self.name = name


class AioRpcError(Exception):  # named like grpc's: Serve's gRPC transport raises it when a connection breaks
    def __init__(self, code):
        super().__init__(code)
        self._code = _Code(code)

    def code(self):
        return self._code


@pytest.mark.parametrize("code,gone", [("UNAVAILABLE", True), ("UNKNOWN", True), ("INTERNAL", True),
                                       ("CANCELLED", True), ("RESOURCE_EXHAUSTED", False),
                                       ("INVALID_ARGUMENT", False)])
def test_a_broken_grpc_connection_counts_as_a_gone_replica(code, gone):
    from serve_app.errors import replica_gone

    assert replica_gone(AioRpcError(code)) is gone
    assert replica_gone(ActorDiedError()) and not replica_gone(ValueError())


def test_a_stream_removed_before_acceptance_is_retried_on_a_live_replica():
    h = Handle(dead={"r-dead"}, error=lambda _msg: AioRpcError("UNKNOWN"))
    req = EngineRequest(request_id="1", prompt_token_ids=[1, 2], max_tokens=4, target_replica="r-dead")
    assert asyncio.run(_texts(ServeEngineClient({"e": h}, None), req)) == ["ok"]
    assert h.sent == ["r-dead", None]


def test_a_request_lost_midway_reopens_on_a_live_replica_or_fails_with_its_loss():
    """service.complete's restart of a request whose replica was lost after its first delta: on a replica the table
    still lists (Serve's pick, away from the lost one), or, with none known, the loss at once."""
    lost = ActorUnavailableError("node lost")
    h = Handle()
    req = EngineRequest(request_id="1", prompt_token_ids=[1, 2], max_tokens=4, target_replica="r-lost")
    client = ServeEngineClient({"e": h}, None, local=_local_table(["r-lost", "r-live"]))

    async def reopened():
        return [c.text async for c in await client.reopen("e", req, lost)]

    assert asyncio.run(reopened()) == ["ok"] and h.sent == [None]
    assert set(client.local.table.cores["e"].loads) == {"r-live"}  # the lost one is off the table

    only = ServeEngineClient({"e": Handle()}, None, local=_local_table(["r-lost"]))
    req = EngineRequest(request_id="2", prompt_token_ids=[1, 2], max_tokens=4, target_replica="r-lost")
    with pytest.raises(ActorUnavailableError) as e:
        asyncio.run(only.reopen("e", req, lost))
    assert e.value is lost and only._engines["e"].sent == []  # nothing sent: Serve would hold it for a replacement


class ElsewhereHandle(Handle):
    """Serve's request router does not list the target yet: replica `taker` takes every call, and says so in its
    acceptance, as the Engine deployment does."""

    def __init__(self, taker):
        super().__init__()
        self.taker = taker

    def remote(self, req):
        gen = super().remote(req)
        gen.__class__ = type("Taken", (Gen,), {"__anext__": _taken(self.taker)})
        return gen


def _taken(taker):
    async def __anext__(self):
        if not self.accepted:
            self.accepted = True
            return EngineChunk(text="", token_ids=[], replica=taker)
        return await Gen.__anext__(self)
    return __anext__


def test_a_request_another_replica_took_moves_its_reservation_there():
    """The reservation (load, placement work, and the prefill and end reports) follows the request to the
    replica that took it, rather than loading the chosen one until the request ends."""
    from serve_app.routing.types import RouteRequest

    local = _local_table(["r-chosen", "r-taker"])
    core = local.table.cores["e"]
    decision = local.choose("e", RouteRequest("1", [1, 2], 32, 8))
    chosen = decision.replica_id
    taker = "r-taker" if chosen == "r-chosen" else "r-chosen"
    client = ServeEngineClient({"e": ElsewhereHandle(taker)}, None, local=local)
    req = EngineRequest(request_id="1", prompt_token_ids=[1, 2], max_tokens=4, target_replica=chosen,
                        reserved_on=chosen)
    assert asyncio.run(_texts(client, req)) == ["ok"]
    loads = core.loads
    assert (loads[chosen].active_requests, loads[taker].active_requests) == (0, 1)
    assert (loads[chosen].routed, loads[taker].routed) == (0, 1)
    assert loads[chosen].recent(core.now()) == 0 and loads[taker].recent(core.now()) > 0
    assert core.metrics()["redirected_reservations"] == 1
    local.mark_prefilled("e", "1", 0)
    local.release("e", "1", 1)
    assert loads[taker].active_requests == 0
    assert (core.rates[taker].prefill.tokens, core.rates[chosen].prefill.tokens) == (32, 0)  # measured there
    # Taken where it was sent: nothing moves.
    local.choose("e", RouteRequest("2", [3, 4], 32, 8))
    req = EngineRequest(request_id="2", prompt_token_ids=[1, 2], max_tokens=4,
                        target_replica=core._inflight["2"].replica_id, reserved_on=core._inflight["2"].replica_id)
    client = ServeEngineClient({"e": ElsewhereHandle(core._inflight["2"].replica_id)}, None, local=local)
    assert asyncio.run(_texts(client, req)) == ["ok"]
    assert core.metrics()["redirected_reservations"] == 1


class NamedDying(DyingHandle):
    """A DyingHandle whose replicas name themselves in their acceptance, as the Engine deployment does: the first
    call's replica is `dying`, every later one `live`."""

    def __init__(self, before, dying, live):
        super().__init__(before)
        self.names = [dying, live]

    def remote(self, req):
        gen = super().remote(req)
        name = self.names[0] if len(self.sent) == 1 else self.names[1]
        gen.__class__ = type("Named", (Gen,), {"__anext__": _taken(name)})
        return gen


def _routed(local, request_id, tokens=32):
    from serve_app.routing.types import RouteRequest

    chosen = local.choose("e", RouteRequest(request_id, [1, 2], tokens, 8)).replica_id
    return chosen, EngineRequest(request_id=request_id, prompt_token_ids=[1, 2], max_tokens=4,
                                 target_replica=chosen, reserved_on=chosen)


def test_a_request_handed_over_from_a_dead_replica_takes_its_reservation_to_the_live_one():
    """The replica died after accepting, before the first delta: the table drops it, and the request's
    reservation (kept meanwhile on no replica) loads the replica that takes the handover, where its prefill is
    measured; nothing stays on no replica."""
    local = _local_table(["r-a", "r-b"])
    core = local.table.cores["e"]
    chosen, req = _routed(local, "1")
    live = "r-b" if chosen == "r-a" else "r-a"
    h = NamedDying([], chosen, live)
    client = ServeEngineClient({"e": h}, None, local=local)
    assert asyncio.run(_texts(client, req)) == ["ok"]
    assert h.sent == [chosen, None] and set(core.loads) == {live}
    assert core.loads[live].active_requests == 1 and core.metrics()["orphaned_reservations"] == 0
    assert (req.reserved_on, req.target_replica) == (live, live)  # a later loss drops this one
    local.mark_prefilled("e", "1", 0)
    local.release("e", "1", 1)
    assert core.loads[live].active_requests == 0 and core.rates[live].prefill.tokens == 32


def test_a_request_lost_midway_is_prefilled_again_where_it_restarts():
    """service.complete's restart after the first delta: the reservation was prefilled on the lost replica; on the
    one that takes it, its prefill loads the replica again until its new first token."""
    local = _local_table(["r-a", "r-b"])
    core = local.table.cores["e"]
    chosen, req = _routed(local, "1")
    local.mark_prefilled("e", "1", 0)
    live = "r-b" if chosen == "r-a" else "r-a"
    client = ServeEngineClient({"e": ElsewhereHandle(live)}, None, local=local)

    async def reopened():
        return [c.text async for c in await client.reopen("e", req, ActorUnavailableError("node lost"))]

    assert asyncio.run(reopened()) == ["ok"]
    load = core.loads[live]
    assert (load.active_requests, load.active_prefill_tokens, load.routed) == (1, 32, 1)
