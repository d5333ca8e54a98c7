"""The trace simulator: metrics are computed right and run the production RouterCore."""

import json

from load.sim_router import LruBlockCache, main, simulate


def _trace():
    # Four interleaved sessions, three turns each; every turn extends its session's previous prompt by a block.
    rows, t = [], 0
    for turn in range(3):
        for s in range(4):
            ids = [1000 * s + k for k in range(4 + turn)]
            rows.append({"timestamp": t, "input_length": 512 * len(ids), "output_length": 10, "hash_ids": ids})
            t += 5000
    return rows


def test_upper_bound_and_kv_reach_it_with_room_to_spare():
    trace = _trace()
    # Turn 2 reuses 4 of 5 blocks, turn 3 reuses 5 of 6, per session.
    expected = (4 * 4 * 512 + 4 * 5 * 512) / sum(r["input_length"] for r in trace)
    kv = simulate(trace, "kv", replicas=2, cache_blocks=64)
    assert kv["upper_bound_hit_rate"] == round(expected, 4)
    assert kv["hit_rate"] == kv["upper_bound_hit_rate"]
    rr = simulate(trace, "round_robin", replicas=3, cache_blocks=64)
    assert rr["hit_rate"] < rr["upper_bound_hit_rate"]


def test_cli_json(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _trace()))
    assert main(["--trace", str(path), "--replicas", "2", "--cache-blocks", "64", "--policy", "kv", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"hit_rate", "upper_bound_hit_rate", "imbalance"} <= out.keys()


def test_lru_evicts_prompt_tails_first():
    c = LruBlockCache(3)
    c.store([1, 2, 3])
    assert c.store([4]) == [3]
    assert c.leading_hits([1, 2, 3]) == 2
