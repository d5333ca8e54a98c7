"""The read-ahead pump (serve_app/streams.py), its use for SSE batching, and merging engine chunks."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.engine.types import EngineChunk, merge_chunks
from serve_app.ingress import sse
from serve_app.streams import Pump


async def _from_queue(q: asyncio.Queue):
    while True:
        item = await q.get()
        if item is None:
            return
        yield item


def test_a_consumer_that_keeps_up_gets_one_item_per_read():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        pump = Pump(_from_queue(q))
        got = []
        for i in range(4):
            q.put_nowait(i)
            got.append(await pump.next_batch())
        q.put_nowait(None)
        with pytest.raises(StopAsyncIteration):
            await pump.next_batch()
        return got

    assert asyncio.run(run()) == [[0], [1], [2], [3]]


def test_a_consumer_that_lags_gets_everything_read_meanwhile_in_order():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        pump = Pump(_from_queue(q))
        q.put_nowait("a")
        first = await pump.next_batch()
        for x in "bcde":
            q.put_nowait(x)
        await asyncio.sleep(0.01)  # the consumer is busy; the pump keeps reading
        second = await pump.next_batch()
        q.put_nowait(None)
        await asyncio.sleep(0)
        with pytest.raises(StopAsyncIteration):
            await pump.next_batch()
        return first, second

    assert asyncio.run(run()) == (["a"], ["b", "c", "d", "e"])


def test_the_sources_error_comes_after_the_items_read_before_it():
    async def failing():
        yield 1
        yield 2
        raise ValueError("engine died")

    async def run():
        pump = Pump(failing())
        await asyncio.sleep(0.01)
        items = await pump.next_batch()
        with pytest.raises(ValueError, match="engine died"):
            await pump.next_batch()
        return items

    assert asyncio.run(run()) == [1, 2]


def test_a_timeout_returns_an_empty_batch_and_reading_goes_on():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        pump = Pump(_from_queue(q))
        idle = await pump.next_batch(timeout=0.02)
        q.put_nowait(7)
        return idle, await pump.next_batch(timeout=5)

    assert asyncio.run(run()) == ([], [7])


def test_each_wait_gets_its_whole_timeout_though_the_timer_is_shared():
    """The pump keeps one timer and moves its deadline: a wait that starts after an earlier wait's timer was set
    must not be woken by that earlier deadline."""

    async def run():
        q: asyncio.Queue = asyncio.Queue()
        pump = Pump(_from_queue(q))
        loop = asyncio.get_running_loop()
        loop.call_later(0.15, q.put_nowait, "a")  # arrives before the first wait's deadline (0.2)
        first = await pump.next_batch(timeout=0.2)
        loop.call_later(0.1, q.put_nowait, "b")  # after the first deadline, before the second's (~0.35)
        second = await pump.next_batch(timeout=0.2)
        start = loop.time()
        idle = await pump.next_batch(timeout=0.05)
        waited = loop.time() - start
        loop.call_later(0.01, q.put_nowait, "c")
        assert await pump.next_batch(timeout=0.1) == ["c"]  # returns early: its timer is still set
        loop.call_later(0.2, q.put_nowait, "d")
        untimed = await pump.next_batch()  # no timeout: that timer must not end this wait empty
        q.put_nowait(None)
        await pump.aclose()
        return first, second, idle, waited, untimed

    first, second, idle, waited, untimed = asyncio.run(run())
    assert (first, second, idle, untimed) == (["a"], ["b"], [], ["d"])
    assert waited >= 0.045  # a full timeout from the wait's own start (timers never fire early)


def test_closing_cancels_the_read_in_flight_and_closes_the_source():
    state = {"cancelled": False, "closed": False}

    async def endless():
        try:
            yield 0
            await asyncio.sleep(3600)
            yield 1
        except asyncio.CancelledError:
            state["cancelled"] = True
            raise
        finally:
            state["closed"] = True

    async def run():
        pump = Pump(endless())
        assert await pump.next_batch() == [0]
        await asyncio.sleep(0.01)  # the pump now waits inside the source
        await pump.aclose()

    asyncio.run(run())
    assert state == {"cancelled": True, "closed": True}


def test_sse_batches_frames_what_piled_up_together_and_keepalives_alone():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        stream = sse.with_keepalive(_from_queue(q), 0.05)
        out = []
        it = sse.batches(stream).__aiter__()
        q.put_nowait("x")
        out.append(await it.__anext__())
        for x in ("y", "z", "w"):
            q.put_nowait(x)
        await asyncio.sleep(0.01)
        out.append(await it.__anext__())
        out.append(await it.__anext__())  # nothing for 50 ms: a keep-alive
        q.put_nowait(None)
        rest = [b async for b in it]
        await stream.aclose()
        return out, rest

    out, rest = asyncio.run(run())
    assert out == [["x"], ["y", "z", "w"], [None]] and rest == []


def test_peeked_stream_hands_over_ready_items_only_after_the_first():
    async def run():
        q: asyncio.Queue = asyncio.Queue()
        for x in (1, 2, 3):
            q.put_nowait(x)
        q.put_nowait(None)
        first, stream = await sse.peek(sse.with_keepalive(_from_queue(q), 5))
        batches = [b async for b in sse.batches(stream)]
        return first, batches

    first, batches = asyncio.run(run())
    assert first == 1 and [x for b in batches for x in b] == [1, 2, 3] and batches[0][0] == 1


def test_merged_chunks_carry_the_same_text_tokens_cache_report_and_end():
    chunks = [
        EngineChunk(text="Hel", token_ids=[1], num_cached_tokens=128),
        EngineChunk(text="lo", token_ids=[2, 3]),
        EngineChunk(text="!", token_ids=[4], finish_reason="stop", stop_reason="</s>"),
    ]
    merged = merge_chunks(chunks)
    assert (merged.text, merged.token_ids, merged.num_cached_tokens) == ("Hello!", [1, 2, 3, 4], 128)
    assert (merged.finish_reason, merged.stop_reason) == ("stop", "</s>")
    assert merge_chunks(chunks[1:2]) is chunks[1]
    assert merge_chunks(chunks[1:]).num_cached_tokens is None
