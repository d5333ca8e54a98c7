"""Start-time fair queuing of tenants within a tier (serve_app/engine/fair_share.py), checked on a small model of
vLLM's priority admission: waiting requests are admitted by (priority, arrival) into a fixed number of slots, a
request begins (its first output) when it is admitted, and runs a fixed number of ticks."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from serve_app.engine.fair_share import COST, MAX_SHARE, PRIORITY_BOUND, SPAN, FairShare


def run(arrivals: list[tuple[int, str | None, int]], slots: int, ticks: int, fair: bool = True,
        shares: dict[str, int] | None = None) -> list[int]:
    """Admission order (indexes into `arrivals`) of requests arriving at (tick, tenant, priority); each runs
    `ticks` ticks. `fair=False` charges nobody: what `ingress.fair_share: false` sends. `shares`: tenants' weights
    (1 where unnamed)."""
    share = FairShare()
    shares = shares or {}
    waiting: list[tuple[int, int, int, int]] = []  # (vLLM priority, arrival order, start tag, index)
    running: list[int] = []  # end ticks
    order: list[int] = []
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    seq = itertools.count()
    tick = 0
    while pending or waiting:
        while pending and arrivals[pending[0]][0] <= tick:
            i = pending.pop(0)
            _, tenant, priority = arrivals[i]
            vprio, start = share.tag(tenant if fair else None, priority, shares.get(tenant, 1))
            heapq.heappush(waiting, (vprio, next(seq), start, i))
        running = [end for end in running if end > tick]
        while waiting and len(running) < slots:
            _, _, start, i = heapq.heappop(waiting)
            share.started(start)
            order.append(i)
            running.append(tick + ticks)
        tick += 1
    return order


def test_one_tenant_alone_is_first_come_first_served():
    arrivals = [(t // 3, "a", 0) for t in range(30)]
    assert run(arrivals, slots=2, ticks=4) == list(range(30))


def test_a_request_after_a_burst_takes_the_next_free_slot():
    burst = [(0, "ci", 0)] * 20
    arrivals = burst + [(3, "dev", 0)]
    order = run(arrivals, slots=2, ticks=5)
    # the two slots were taken by the burst; the dev request is admitted next, before the 18 ci requests waiting
    assert order.index(20) == 2
    # first come, first served (the peer's default): it waits for the whole burst
    assert run(arrivals, slots=2, ticks=5, fair=False).index(20) == 20


def test_two_tenants_with_requests_waiting_alternate():
    arrivals = [(0, "a", 0)] * 10 + [(1, "b", 0)] * 10
    order = run(arrivals, slots=1, ticks=3)
    tenants = ["a" if i < 10 else "b" for i in order]
    # a's first began alone; b's first is tagged as it was (the virtual time), so from then on they take turns
    assert "".join(tenants) == "ab" * 10
    assert [i for i in order if i < 10] == list(range(10)) and [i for i in order if i >= 10] == list(range(10, 20))


def test_an_idle_tenant_saves_no_credit_and_a_busy_one_carries_no_debt():
    # b sends one request a tick, twice what the engine serves, so its requests queue; a arrives with ten.
    # a alternates with b's queue: it neither goes first for saved-up credit (all ten ahead of b's queue) nor waits
    # behind b's queue for b's use of the engine while nobody else wanted it (debt).
    arrivals = [(t, "b", 0) for t in range(30)] + [(40, "a", 0)] * 10 + [(40 + t, "b", 0) for t in range(10)]
    seq = "".join("a" if 30 <= i < 40 else "b" for i in run(arrivals, slots=1, ticks=2))
    assert seq[seq.index("a"):seq.rindex("a") + 1] == "ab" * 9 + "a", seq
    assert run(arrivals, slots=1, ticks=2, fair=False)[-20:-10] == list(range(30, 40))  # FCFS: behind b's queue


def test_tiers_and_hints_still_come_first():
    # a tenant with a better priority goes ahead whatever the tags: fairness only orders equal priorities
    share = FairShare()
    low = [share.tag("lots", 0)[0] for _ in range(1000)]
    high, _ = share.tag("top", -1)
    later_low, _ = share.tag("new", 0)
    assert high < min(low) and high < later_low
    assert share.tag("lots", -(PRIORITY_BOUND - 1))[0] < share.tag("x", -(PRIORITY_BOUND - 2))[0]
    with pytest.raises(ValueError):
        share.tag("x", PRIORITY_BOUND)


def test_uncharged_requests_take_the_virtual_time_and_move_no_tenants_share():
    share = FairShare()
    for _ in range(5):
        share.tag("a", 0)
    assert [share.tag(None, 0)[1] for _ in range(3)] == [0, 0, 0]
    assert share.tag("a", 0)[1] == 5 * COST and share.tag("b", 0)[1] == 0
    share.started(4 * COST)
    assert share.tag(None, 0)[1] == 4 * COST and share.tag("b", 0)[1] == 4 * COST


def test_tags_and_order_are_those_of_priority_then_tag_for_any_arrivals():
    rng = random.Random(7)
    for _ in range(50):
        arrivals = [(rng.randrange(20), rng.choice("abc"), rng.choice((0, 0, 0, -1000))) for _ in range(40)]
        order = run(arrivals, slots=rng.randrange(1, 4), ticks=rng.randrange(1, 5))
        assert sorted(order) == list(range(40))  # every request admitted once
        for tenant in "abc":  # a tenant's own requests keep their order within a priority
            for prio in (0, -1000):
                mine = [i for i in order if arrivals[i][1:] == (tenant, prio)]
                assert mine == sorted(mine, key=lambda i: (arrivals[i][0], i))


def test_the_table_keeps_only_tenants_ahead_of_the_virtual_time():
    share = FairShare()
    for n in range(1000):
        share.started(share.tag(f"t{n}", 0)[1])  # each of many tenants sends one request, which begins
        share.started(share.tag("busy", 0)[1])  # while one tenant's stream of requests moves V on
    assert len(share._finish) <= 257
    assert SPAN // COST > 2**30  # billions of admissions before the table starts again


def test_a_tenant_of_share_two_is_admitted_twice_as_often_while_both_wait():
    arrivals = [(0, "a", 0)] * 30 + [(1, "b", 0)] * 30
    order = run(arrivals, slots=1, ticks=3, shares={"b": 2})
    seq = "".join("a" if i < 30 else "b" for i in order)
    # a's first began alone; then, while both have requests waiting, b takes two admissions to a's one
    assert seq[:31] == "a" + "bba" * 10, seq
    weights = {"a": 3, "b": 1, "c": 2}
    arrivals = [(0, t, 0) for t in "abc" for _ in range(60)]
    first = [arrivals[i][1] for i in run(arrivals, slots=2, ticks=2, shares=weights)[:60]]
    assert {t: first.count(t) for t in "abc"} == {"a": 30, "b": 10, "c": 20}


def test_a_share_weights_only_within_its_tier_and_is_bounded():
    share = FairShare()
    low = [share.tag("heavy", 0, MAX_SHARE)[0] for _ in range(100)]
    assert share.tag("light", -1)[0] < min(low)  # a better tier still goes first
    with pytest.raises(ValueError):
        share.tag("x", 0, MAX_SHARE + 1)
    with pytest.raises(ValueError):
        share.tag("x", 0, 0)


def test_past_the_span_the_table_starts_again_and_old_tags_move_nothing():
    share = FairShare()
    share.vtime = share._top = SPAN - 2 * COST  # as after ~2**31 admissions of share 1
    _, old = share.tag("a", 0)
    assert old == SPAN - 2 * COST
    _, fresh = share.tag("a", 0)  # its finish tag would pass the span: the table starts again at 0
    assert fresh == 0 and share.tag("b", 0)[1] == 0
    share.started(old)  # a request tagged before the restart begins: V stays where the new tags are
    assert share.vtime == 0
    assert share.tag("c", 0)[0] < SPAN


async def test_the_engine_hands_vllm_the_tagged_priority_and_moves_the_virtual_time_at_the_first_output():
    import asyncio
    from types import SimpleNamespace

    from serve_app.engine.types import EngineRequest
    from serve_app.engine.vllm_engine import VLLMEngine
    from serve_app.settings import ModelConfig

    seen: list[tuple[str, int]] = []
    gates: dict[str, asyncio.Event] = {}

    class AsyncLLM:  # the call generate makes of vLLM's AsyncLLM, recorded; a request's output waits for its gate
        def generate(self, prompt, params, request_id, priority):
            seen.append((request_id, priority))
            gate = gates.setdefault(request_id, asyncio.Event())

            async def outputs():
                await gate.wait()
                done = SimpleNamespace(text="x", token_ids=[1], finish_reason="stop", stop_reason=None)
                yield SimpleNamespace(outputs=[done], finished=True, num_cached_tokens=0, metrics=None)
            return outputs()

    eng = VLLMEngine(ModelConfig(id="m"), "/nowhere", kv_events=False)
    eng.engine, eng.fair = AsyncLLM(), FairShare()

    def run(rid: str, tenant: str | None, share: int = 1) -> asyncio.Task:
        req = EngineRequest(request_id=rid, prompt_token_ids=[1], max_tokens=1, priority=-3, tenant=tenant,
                            share=share)

        async def consume():
            return [c async for c in eng.generate(req)]
        return asyncio.create_task(consume())

    a1, a2 = run("a1", "a"), run("a2", "a", share=2)
    await asyncio.sleep(0)
    gates["a1"].set()
    assert (await a1)[-1].finish_reason == "stop"  # a1 began at tag 0; a2, tag COST, waits
    b1 = run("b1", "b")
    await asyncio.sleep(0)  # b comes in at V = 0, ahead of a2
    gates["a2"].set()
    await a2  # a2's first output: V = COST
    w = run("w", None)  # uncharged: at V
    await asyncio.sleep(0)
    for g in gates.values():
        g.set()
    await asyncio.gather(b1, w)
    assert seen == [("a1", -3 * SPAN), ("a2", -3 * SPAN + COST), ("b1", -3 * SPAN), ("w", -3 * SPAN + COST)]
    assert eng.fair.vtime == COST
    assert eng.fair._finish["a"] == COST + COST // 2  # a2 was sent with share 2: half the cost
