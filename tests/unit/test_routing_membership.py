"""Replicas come and go: the Router's registrations against Serve's running set, and the core dropping a dead
replica with everything it held (index, load, rates, reservations)."""

from serve_app.routing.core import RouteRequest, RouterCore
from serve_app.routing.hashing import block_hashes
from serve_app.routing.membership import Registrations

BS = 4
PROMPT = list(range(40))


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


REG = ("tcp://h:1", "tcp://h:2", BS)


def test_a_replica_registered_before_serve_lists_it_is_registered_again_when_it_appears():
    regs = Registrations(clock=Clock())
    regs.add("new", REG)
    assert regs.reconcile(["old"], known=["old", "new"]) == []  # dropped while starting: not listed yet
    assert regs.reconcile(["old", "new"], known=["old"]) == [("new", REG)]
    assert regs.reconcile(["old", "new"], known=["old", "new"]) == []  # already back


def test_registrations_absent_longer_than_keep_are_forgotten():
    clock = Clock()
    regs = Registrations(keep_s=60, clock=clock)
    regs.add("dead", REG)
    regs.add("live", REG)
    regs.reconcile(["live"], known=["dead", "live"])
    clock.t = 59
    regs.reconcile(["live"], known=["live"])
    assert "dead" in regs  # still within keep: it may be a replica still starting
    clock.t = 61
    regs.reconcile(["live"], known=["live"])
    assert "dead" not in regs and "live" in regs and len(regs) == 1
    assert regs.reconcile(["live", "dead"], known=["live"]) == []  # an id that never registered again


def test_a_replica_seen_again_is_no_longer_absent():
    clock = Clock()
    regs = Registrations(keep_s=60, clock=clock)
    regs.add("r", REG)
    regs.reconcile([], known=["r"])
    clock.t = 50
    regs.reconcile(["r"], known=[])
    clock.t = 100
    regs.reconcile([], known=["r"])  # absent again since 100, not since 0
    assert "r" in regs and regs.stats() == {"registered": 1, "absent": 1}


def test_a_dead_replica_leaves_nothing_behind_and_a_joiner_gets_traffic():
    clock = Clock()
    c = RouterCore("ttft", BS, clock=clock, seed=1)
    c.sync_replicas(["a", "b"])
    hashes = block_hashes(PROMPT, BS)
    c.blocks_stored("b", hashes)
    on_b = [c.choose(RouteRequest(f"r{i}", hashes, len(PROMPT), 16, f"s{i}")) for i in range(4)]
    assert any(d.replica_id == "b" for d in on_b)
    c.mark_prefilled("r0")
    c.sync_replicas(["a"])  # b's node is lost with requests in flight
    m = c.metrics()
    assert set(m["replicas"]) == {"a"}
    assert m["inflight"] == sum(d.replica_id == "a" for d in on_b)  # b's reservations went with it
    assert "b" not in c.index.replicas and "b" not in c.rates
    for i in range(4):  # the ingress reports each stream's end later: no error, no double count
        c.release(f"r{i}", 0)
    m = c.metrics()
    assert m["inflight"] == 0 and m["replicas"]["a"]["active_requests"] == 0
    assert m["replicas"]["a"]["active_prefill_tokens"] == 0 and m["replicas"]["a"]["active_decode_tokens"] == 0
    d = c.choose(RouteRequest("after", hashes, len(PROMPT), 16, "s1"))
    assert d.replica_id == "a"  # the session whose history died with b goes on where it can
    c.release("after", 0)
    c.sync_replicas(["a", "c"])  # a node is added: its replica joins
    placed = [c.choose(RouteRequest(f"n{i}", block_hashes([1000 + i] * 40, BS), 40, 16)).replica_id
              for i in range(4)]
    assert "c" in placed and c.metrics()["replicas"]["c"]["routed"] == placed.count("c")
