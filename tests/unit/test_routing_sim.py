"""The trace simulator: engine model, metrics, the agentic trace generator; it runs the production RouterCore."""

import json

import pytest

from load.gen_agentic_trace import AgenticParams, generate
from load.sim_engine import TRACE_BLOCK, EngineParams, EngineReplica, KvBlockPool, SimRequest
from load.sim_router import check_bar, main, simulate


def _trace():
    # Four interleaved sessions, three turns each; every turn extends its session's previous prompt by a block.
    rows, t = [], 0
    for turn in range(3):
        for s in range(4):
            ids = [1000 * s + k for k in range(4 + turn)]
            rows.append({"timestamp": t, "input_length": 512 * len(ids), "output_length": 10, "hash_ids": ids})
            t += 5000
    return rows


@pytest.mark.parametrize("policy", ["kv", "ttft"])
def test_upper_bound_and_cache_aware_policies_reach_it(policy):
    trace = _trace()
    # Turn 2 reuses 4 of 5 blocks, turn 3 reuses 5 of 6, per session.
    expected = (4 * 4 * 512 + 4 * 5 * 512) / sum(r["input_length"] for r in trace)
    r = simulate(trace, policy, replicas=2, cache_blocks=64)
    assert r["upper_bound_hit_rate"] == round(expected, 4)
    assert r["hit_rate"] == r["upper_bound_hit_rate"]
    rr = simulate(trace, "round_robin", replicas=3, cache_blocks=64)
    assert rr["hit_rate"] < rr["upper_bound_hit_rate"]


def test_cli_json(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _trace()))
    assert main(["--trace", str(path), "--replicas", "2", "--cache-blocks", "64", "--policy", "kv", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"hit_rate", "upper_bound_hit_rate", "imbalance", "ttft_p99_s"} <= out.keys()


def test_compare_writes_a_result_file_with_provenance(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _trace()))
    out = tmp_path / "r.json"
    assert main(["--compare", "--trace", str(path), "--replicas", "2", "--cache-blocks", "64",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"command", "commit", "host", "date", "engine", "traces", "bar_failures"} <= doc.keys()
    assert {r["policy"] for r in doc["results"]} >= {"round_robin", "least_loaded", "prefix_affinity", "ttft"}


def test_check_bar_flags_a_slower_policy():
    base = {"trace": "t", "speedup": 1.0, "cache_blocks": 64, "events": True, "fraction_of_upper_bound": 0.99}
    rows = [{**base, "policy": "round_robin", "ttft_mean_s": 1.0, "ttft_p99_s": 2.0},
            {**base, "policy": "ttft", "ttft_mean_s": 1.1, "ttft_p99_s": 2.0, "fraction_of_upper_bound": 0.9}]
    failures = check_bar(rows)
    assert len(failures) == 2 and "ttft_mean_s" in failures[0] and "hit rate" in failures[1]


def test_pool_evicts_only_free_blocks_tail_first():
    removed = []
    pool = KvBlockPool(4, on_removed=removed.extend)
    a = SimRequest("a", 0.0, [1, 2, 3], 3 * TRACE_BLOCK, 1)
    pool.admit(a, 0, 0)
    a.done = a.n_in
    pool.computed(a)
    pool.release(a)  # blocks 1 2 3 free but cached; 3 (the tail) first in line for eviction
    b = SimRequest("b", 0.0, [1, 2, 9], 3 * TRACE_BLOCK, 1)
    assert pool.leading_hits(b.hashes) == 2
    pool.admit(b, 2, 1)  # needs 2 new blocks: evicts only 3 (1 and 2 are now in use by b)
    assert removed == [3]
    assert pool.leading_hits([1, 2, 3]) == 2


def test_engine_chunks_a_long_prefill_and_interleaves_decodes():
    p = EngineParams(prefill_tps=1000.0, step_overhead_s=0.001, decode_seq_s=0.0, step_tokens=1024, cache_blocks=64)
    first, done = {}, {}
    e = EngineReplica("r", p, on_first_token=lambda r, t: first.setdefault(r.id, t),
                      on_finish=lambda r, t: done.setdefault(r.id, t))
    e.arrive(SimRequest("long", 0.0, list(range(8)), 4096, 5), 0.0)
    while e.next_event is not None and "long" not in first:
        e.advance()
    assert first["long"] == pytest.approx(4096 / 1000.0 + 4 * 0.001)  # four 1024-token chunks
    e.arrive(SimRequest("short", first["long"], [100], 100, 2), first["long"])
    while e.next_event is not None:
        e.advance()
    # It waited for the decode step in progress, then its prefill ran in a step alongside the long one's next
    # decode token, not after the long one finished.
    assert first["short"] == pytest.approx(first["long"] + 0.001 + (0.001 + 0.1))
    assert first["short"] < done["long"]


def test_engine_admits_waiting_requests_by_priority_and_keeps_admitted_ones_in_place():
    """vLLM's priority scheduling: waiting requests go in (priority, arrival) order, lower first; one admitted
    keeps its slot whatever arrives after it."""
    p = EngineParams(prefill_tps=1000.0, step_overhead_s=0.001, decode_seq_s=0.0, max_seqs=1, cache_blocks=64)
    order = []
    e = EngineReplica("r", p, on_first_token=lambda r, t: order.append(r.id), on_finish=lambda r, t: None)
    e.arrive(SimRequest("running", 0.0, [1], 500, 50, priority=0), 0.0)
    for rid, prio in (("low", 0), ("lower", 5), ("high", -1000), ("high2", -1000)):
        e.arrive(SimRequest(rid, 0.001, [hash(rid)], 100, 2, priority=prio), 0.001)
    while e.next_event is not None:
        e.advance()
    assert order == ["running", "high", "high2", "low", "lower"]


def test_tiers_report_each_tiers_ttft_and_the_higher_one_waits_less():
    rows = generate(AgenticParams(sessions=24, turns=6, arrival_rate=4.0, seed=7))
    r = simulate(rows, "ttft", replicas=2, cache_blocks=256, engine=EngineParams(max_seqs=4), tiers=0.3)
    hi, lo = r["high_tier"], r["low_tier"]
    assert hi["requests"] + lo["requests"] == r["requests"] and hi["requests"] and lo["requests"]
    assert hi["ttft_mean_s"] < lo["ttft_mean_s"] / 3  # slots are short: the low tier waits for them
    # The tier is the session's: every run of the same trace and seed puts the same sessions up.
    assert simulate(rows, "ttft", replicas=2, cache_blocks=256, engine=EngineParams(max_seqs=4),
                    tiers=0.3)["high_tier"] == hi
    assert "high_tier" not in simulate(rows, "ttft", replicas=2, cache_blocks=256)


def test_agentic_trace_shape_and_prefix_sharing():
    rows = generate(AgenticParams(sessions=20, turns=4, seed=3))
    assert rows == sorted(rows, key=lambda r: r["timestamp"])
    assert {"timestamp", "input_length", "output_length", "hash_ids", "session_id"} <= rows[0].keys()
    for r in rows:
        assert len(r["hash_ids"]) == -(-r["input_length"] // 512)
    shared = rows[0]["hash_ids"][:36]
    assert all(r["hash_ids"][:36] == shared for r in rows)  # one shared prefix of 36 blocks
    by_session = {}
    for r in rows:
        by_session.setdefault(r["session_id"], []).append(r)
    for turns in by_session.values():  # each turn extends the previous one: its full blocks are kept
        for prev, nxt in zip(turns, turns[1:]):
            full = prev["input_length"] // 512
            assert nxt["hash_ids"][:full] == prev["hash_ids"][:full]
            assert nxt["input_length"] > prev["input_length"]
    assert generate(AgenticParams(sessions=20, turns=4, seed=3)) == rows  # reproducible from the seed
