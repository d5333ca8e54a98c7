"""RouterCore and policies: scoring, reservation, prediction mode, replica removal."""

import pytest

from serve_app.routing.core import RouteRequest, RouterCore
from serve_app.routing.hashing import block_hashes
from serve_app.routing.index import EVENTS, PREDICTED, ReplicaBlocks
from serve_app.routing.kv_events import KvFeeds

BS = 4


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def req(rid, toks, out=16, session=None):
    return RouteRequest(rid, block_hashes(toks, BS), len(toks), out, session)


def core(policy="kv", **kw):
    c = RouterCore(policy, BS, clock=kw.pop("clock", Clock()), seed=1, **kw)
    c.sync_replicas(["a", "b", "c"])
    for r in "abc":
        c.set_mode(r, EVENTS)
    return c


PROMPT = list(range(40))  # 10 blocks


def test_kv_prefers_the_replica_holding_the_prefix():
    c = core()
    c.blocks_stored("b", block_hashes(PROMPT, BS)[:8])
    d = c.choose(req("1", PROMPT + [7, 7]))
    assert (d.replica_id, d.cached_blocks) == ("b", 8)


def test_overlap_is_leading_blocks_only():
    c = core()
    hashes = block_hashes(PROMPT, BS)
    c.blocks_stored("a", hashes[1:])  # everything but the first block: useless to a prefix cache
    c.blocks_stored("c", hashes[:2])
    assert c.choose(req("1", PROMPT)).replica_id == "c"


def test_load_outweighs_a_small_overlap():
    c = core(overlap_weight=1.0)
    c.blocks_stored("a", block_hashes(PROMPT, BS)[:1])
    for i in range(3):  # a is busy with long decodes
        c._reserve(RouteRequest(f"x{i}", [], 0, 1000), "a", 0, 0.0)
    assert c.choose(req("1", PROMPT)).replica_id != "a"


def test_reservation_spreads_a_burst_of_identical_new_prompts():
    c = core(overlap_weight=1.0)
    chosen = {c.choose(req(str(i), PROMPT)).replica_id for i in range(3)}
    assert chosen == {"a", "b", "c"}


def test_release_and_prefilled_undo_the_reservation():
    c = core()
    d = c.choose(req("1", PROMPT, out=50))
    load = c.loads[d.replica_id]
    assert (load.active_requests, load.active_prefill_tokens, load.active_decode_tokens) == (1, 40, 50)
    c.mark_prefilled("1")
    assert (load.active_requests, load.active_prefill_tokens, load.active_decode_tokens) == (1, 0, 50)
    c.release("1")
    c.release("1")  # idempotent
    assert (load.active_requests, load.active_prefill_tokens, load.active_decode_tokens) == (0, 0, 0)


def test_reservation_counts_only_uncached_prefill():
    c = core()
    c.blocks_stored("a", block_hashes(PROMPT, BS))
    d = c.choose(req("1", PROMPT + [1, 2]))
    assert d.replica_id == "a" and c.loads["a"].active_prefill_tokens == 2


def test_unreleased_reservations_expire():
    clock = Clock()
    c = core(clock=clock, reservation_ttl_s=10)
    c.choose(req("1", PROMPT))
    clock.t = 11
    c.choose(req("2", [9] * 8))
    assert c.metrics()["inflight"] == 1 and c.expired_reservations == 1


def test_session_breaks_ties_only():
    c = core()
    first = c.choose(req("1", [5] * 8, session="s")).replica_id
    c.release("1")
    assert c.choose(req("2", [6] * 8, session="s")).replica_id == first  # all equal: the session's replica
    c.release("2")
    other = next(r for r in "abc" if r != first)
    c.blocks_stored(other, block_hashes(PROMPT, BS))
    assert c.choose(req("3", PROMPT, session="s")).replica_id == other  # a real cache hit beats affinity


def test_session_policy_is_sticky():
    c = core("session")
    first = c.choose(req("1", PROMPT, session="s")).replica_id
    for i in range(3):
        assert c.choose(req(f"n{i}", PROMPT, session="s")).replica_id == first


def test_round_robin_cycles():
    c = core("round_robin")
    assert [c.choose(req(str(i), PROMPT)).replica_id for i in range(4)] == ["a", "b", "c", "a"]


def test_set_policy_switches_scoring_and_keeps_the_index():
    c = core("round_robin")
    c.blocks_stored("b", block_hashes(PROMPT, BS))
    assert c.choose(req("1", PROMPT)).replica_id == "a"  # round robin ignores b's cache
    c.set_policy("kv")
    assert c.policy == "kv"
    assert c.choose(req("2", PROMPT)).replica_id == "b"  # the index survived the switch
    with pytest.raises(ValueError):
        c.set_policy("nope")


def test_least_loaded_ignores_cache():
    c = core("least_loaded")
    c.blocks_stored("a", block_hashes(PROMPT, BS))
    c._reserve(RouteRequest("x", [], 0, 10), "a", 0, 0.0)
    assert c.choose(req("1", PROMPT)).replica_id != "a"


def test_predicted_mode_learns_from_decisions_and_forgets_after_ttl():
    clock = Clock()
    c = RouterCore("kv", BS, clock=clock, prediction_ttl_s=60, seed=0)
    c.sync_replicas(["a", "b"])
    assert c.metrics()["replicas"]["a"]["mode"] == PREDICTED
    first = c.choose(req("1", PROMPT)).replica_id
    c.release("1")
    clock.t = 30
    assert c.choose(req("2", PROMPT)).cached_blocks == 10
    c.release("2")
    clock.t = 200
    d = c.choose(req("3", PROMPT))
    assert d.cached_blocks == 0 and first in c.loads


def test_predicted_size_cap_drops_oldest():
    rb = ReplicaBlocks(PREDICTED, ttl_s=1e9, max_blocks=3)
    rb.add([1, 2, 3], 0)
    rb.add([1], 1)  # touch
    rb.add([4], 2)
    assert list(rb.blocks) == [3, 1, 4]


def test_removed_replica_leaves_index_and_loads():
    c = core()
    c.blocks_stored("b", block_hashes(PROMPT, BS))
    assert c.choose(req("1", PROMPT)).replica_id == "b"
    c.sync_replicas(["a", "c"])
    assert "b" not in c.index.replicas and "b" not in c.loads and c.metrics()["inflight"] == 0
    assert c.metrics()["orphaned_reservations"] == 1  # kept for a handover to attach (`redirect`)
    assert c.choose(req("2", PROMPT)).replica_id in {"a", "c"}


def test_no_candidates_is_an_error():
    with pytest.raises(ValueError):
        RouterCore("kv", BS).choose(req("1", PROMPT), [])


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError):
        RouterCore("nope", BS)


def test_prefix_affinity_follows_rays_rules():
    c = core("prefix_affinity")
    first = c.choose(req("1", PROMPT)).replica_id
    c.release("1")
    assert c.choose(req("2", PROMPT + [1] * 8)).replica_id == first  # match rate >= 0.1: deepest match
    c.release("2")
    other = c.choose(req("3", [7] * 40)).replica_id  # no match: the smallest tenant
    assert other != first


def test_new_prompt_goes_where_least_new_cache_was_written():
    c = core()
    c.loads["a"].add_recent(10_000, 0.0)
    c.loads["b"].add_recent(5_000, 0.0)
    assert c.choose(req("1", [3] * 40)).replica_id == "c"


def test_new_prompt_avoids_a_replica_far_busier_than_the_idlest():
    c = core()
    c.loads["a"].add_recent(10_000, 0.0)
    c.loads["b"].add_recent(10_000, 0.0)
    c._reserve(RouteRequest("x", [], 0, 0), "c", 40 * 100, 0.0)  # 100 prompts' worth of queued prefill
    assert c.choose(req("1", [3] * 40)).replica_id != "c"


def test_a_decision_never_carried_out_leaves_no_cache_footprint_behind():
    """Placement memory (where new prompts' prefill went) counts what a replica really prefilled: a reservation
    released as unused takes its work back; one that ran and whose report was lost (reconcile, expiry) keeps it."""
    clock = Clock()
    c = core(clock=clock)
    first = c.choose(req("1", [3] * 40)).replica_id
    assert c.loads[first].recent(0.0) == 40 and c.loads[first].routed == 1
    clock.t = 600.0
    assert c.release("1", measured=False, unused=True)
    assert c.loads[first].recent(clock.t) == 0 and c.loads[first].routed == 0
    # The next new prompt may go there again: it is no busier than the others.
    assert c.choose(req("2", [5] * 40)).replica_id == first
    # Ran, its end never reported: the footprint is real.
    assert c.release("2", measured=False)
    assert c.loads[first].recent(clock.t) == 40


def test_a_reservation_follows_its_request_to_the_replica_that_took_it():
    """`redirect`: Serve's handle gave the request to another replica than the one chosen. Its load, its
    placement work and its later reports (prefill rate, end) are that replica's; the chosen one is as before."""
    clock = Clock()
    c = core(clock=clock)
    chosen = c.choose(req("1", [3] * 40, out=16)).replica_id
    taker = next(r for r in "abc" if r != chosen)
    clock.t = 600.0
    work = c.loads[chosen].recent(clock.t)
    assert c.redirect("1", taker)
    assert not c.redirect("1", taker) and not c.redirect("1", "unknown") and not c.redirect("no-such", chosen)
    old, new = c.loads[chosen], c.loads[taker]
    assert (old.active_requests, old.active_prefill_tokens, old.active_decode_tokens, old.routed) == (0, 0, 0, 0)
    assert (new.active_requests, new.active_prefill_tokens, new.active_decode_tokens, new.routed) == (1, 40, 16, 1)
    assert work > 0 and old.recent(clock.t) == 0 and new.recent(clock.t) == 40  # prefilled there from now
    assert c.redirected("1") and c.metrics()["redirected_reservations"] == 1
    clock.t = 601.0
    c.mark_prefilled("1", 0)
    assert not c.redirect("1", chosen)  # prefilled where it is: it stays
    assert (c.rates[taker].prefill.tokens, c.rates[chosen].prefill.tokens) == (40, 0)
    assert c.release("1", 16) and new.active_requests == 0 and new.active_decode_tokens == 0


def test_a_redirected_request_takes_its_predicted_blocks_and_its_session_along():
    """Without KV events the index is predicted from decisions: the prompt's blocks are predicted where the
    request ran, not where it was meant to (the blocks held there before stay), and the session's next turn
    goes where its prefix is."""
    c = RouterCore("kv", BS, clock=Clock(), seed=1)
    c.sync_replicas(["a", "b"])
    shared = block_hashes(PROMPT, BS)[:4]
    c.index.replicas["a"].add(shared, 0.0)
    c.index.replicas["b"].add(shared, 0.0)
    first = req("1", PROMPT + [9] * 8, session="s")
    chosen = c.choose(first).replica_id
    taker = "b" if chosen == "a" else "a"
    assert c.redirect("1", taker)
    hashes = first.block_hashes
    assert all(h in c.index.replicas[taker] for h in hashes)
    assert all(h in c.index.replicas[chosen] for h in shared)
    assert not any(h in c.index.replicas[chosen] for h in hashes[4:])
    assert c.session_replica("s") == taker
    c.release("1", 4)
    nxt = c.choose(req("2", PROMPT + [9] * 8 + [1] * 8, session="s"))
    assert (nxt.replica_id, nxt.cached_blocks) == (taker, len(hashes))


def test_a_redirected_prefill_is_estimated_from_the_takers_index():
    c = core()
    c.blocks_stored("a", block_hashes(PROMPT, BS)[:6])
    assert c.choose(req("1", PROMPT), ["b"]).replica_id == "b"
    assert c.loads["b"].active_prefill_tokens == 40
    c.blocks_stored("b", block_hashes(PROMPT, BS)[:2])  # what b held before the move is not b's to lose
    assert c.redirect("1", "a")
    assert (c.loads["a"].active_prefill_tokens, c.loads["b"].active_prefill_tokens) == (16, 0)
    assert c.loads["a"].recent(c.now()) == 16


def test_a_request_handed_over_from_a_lost_replica_takes_its_reservation_along():
    """Its replica died (dropped from the table) and the ingress started the request again on a live one: the
    reservation, kept on no replica meanwhile, attaches there with its session's home; the prefill is measured
    from the handover. One never handed over ends with its release and touches no replica's load."""
    clock = Clock()
    c = core(clock=clock)
    c.blocks_stored("b", block_hashes(PROMPT, BS))
    assert c.choose(req("1", PROMPT + [7] * 8, session="s")).replica_id == "b"
    assert c.choose(req("2", [5] * 40), ["a"]).replica_id == "a"
    c._reserve(RouteRequest("3", [], 0, 8), "b", 40, 0.0)
    clock.t = 30.0
    c.sync_replicas(["a", "c"])  # b is lost
    m = c.metrics()
    assert (m["inflight"], m["orphaned_reservations"]) == (1, 2)
    assert not c.redirect("1", "b")  # not a replica any more
    c.blocks_stored("c", block_hashes(PROMPT, BS)[:4])
    clock.t = 31.0
    assert c.redirect("1", "c", restart=True)
    load = c.loads["c"]
    assert (load.active_requests, load.active_prefill_tokens, load.active_decode_tokens, load.routed) == (
        1, 48 - 16, 16, 1)  # c holds 4 of its blocks
    assert c.session_replica("s") == "c" and c.metrics()["orphaned_reservations"] == 1
    clock.t = 33.0
    c.mark_prefilled("1", 16)
    assert c.rates["c"].ttft.m1 == pytest.approx(2.0)  # from the handover, not the decision
    # The replica id comes back (a flapping membership report): the orphan is not its load.
    c.sync_replicas(["a", "b", "c"])
    assert c.release("3") and c.loads["b"].active_requests == 0 and c.loads["b"].active_prefill_tokens == 0
    assert c.metrics()["orphaned_reservations"] == 0


def test_a_request_restarted_after_its_first_token_is_prefilled_again_where_it_went():
    """`restart`: lost midway through its answer and started again on another replica while the lost one is still
    listed. It ran there (placement work and count stay), it holds nothing there any more, and it prefills again
    where it went."""
    clock = Clock()
    c = core(clock=clock)
    chosen = c.choose(req("1", [3] * 40, out=16)).replica_id
    c.mark_prefilled("1", 0)
    taker = next(r for r in "abc" if r != chosen)
    assert not c.redirect("1", taker)  # prefilled: only a restart moves it
    assert c.redirect("1", taker, restart=True)
    old, new = c.loads[chosen], c.loads[taker]
    assert (old.active_requests, old.active_decode_tokens, old.routed, old.recent(0.0)) == (0, 0, 1, 40)
    assert (new.active_requests, new.active_prefill_tokens, new.active_decode_tokens, new.routed) == (1, 40, 16, 1)
    assert c.rates[chosen].decoding == 0 and c.rates[taker].prefilling == 1


def test_prefix_affinity_puts_a_redirected_prompt_under_the_replica_that_ran_it():
    c = core("prefix_affinity")
    r = req("1", PROMPT)
    chosen = c.choose(r).replica_id
    taker = next(x for x in "abc" if x != chosen)
    assert c.redirect("1", taker)
    assert all(h in c._policy.tree[taker] for h in r.block_hashes)
    c.release("1")
    assert c.choose(req("2", PROMPT + [1] * 8), [taker, next(x for x in "abc" if x not in (chosen, taker))]
                    ).replica_id == taker


def test_register_replica_mode_follows_the_event_feed():
    c = RouterCore("kv", BS)
    feeds = KvFeeds(c)
    feeds.register("p", None, None, BS)
    feeds.register("e", "tcp://127.0.0.1:1", None, BS)  # no running loop: events via apply
    modes = {r: m["mode"] for r, m in c.metrics()["replicas"].items()}
    assert modes == {"p": PREDICTED, "e": EVENTS}
    c2 = RouterCore("kv", BS)
    KvFeeds(c2, enabled=False).register("e", "tcp://127.0.0.1:1", None, BS)
    assert c2.metrics()["replicas"]["e"]["mode"] == PREDICTED


def test_a_removed_replica_loses_its_feed_and_the_policys_memory():
    c = RouterCore("prefix_affinity", BS, seed=0)
    feeds = KvFeeds(c)
    for rid in ("a", "b"):
        feeds.register(rid, "tcp://127.0.0.1:1", None, BS)
    c.choose(req("1", PROMPT), ["a", "b"])
    routed = next(iter(c._policy.tree))
    c.sync_replicas([r for r in ("a", "b") if r != routed])
    feeds.retain()
    assert routed not in feeds.feeds and routed not in c._policy.tree and len(feeds.feeds) == 1


def test_block_size_comes_from_the_first_engine():
    c = RouterCore("kv", 16)
    c.register_replica("r", 128)
    assert c.block_size == 128
