"""The delta channel (serve_app/engine/delta_channel.py) over real ZMQ sockets on localhost, no Ray."""

from __future__ import annotations

import asyncio
import random

import pytest

from serve_app.engine import delta_channel
from serve_app.engine.delta_channel import DeltaReceiver, DeltaSender, Inbox, _row, decode, encode
from serve_app.engine.types import EngineChunk


def _chunk(i: int, finish: str | None = None) -> EngineChunk:
    return EngineChunk(f"t{i}é\n\"", [i, i + 1], finish_reason=finish, stop_reason=None if finish is None else "</s>",
                       num_cached_tokens=128 if i == 0 else None)


def test_frames_round_trip_every_field():
    chunks = [_chunk(0), _chunk(1), EngineChunk("", [], "error", 7, None, "boom"), _chunk(2, "stop")]
    chunks[0].engine_ms = {"handoff": 0.25, "queued": 1.5, "prefill": 30.0, "out": 0.75}
    rows = [_row(k, c) for k, c in enumerate(chunks)]
    assert decode(encode(rows)) == list(enumerate(chunks))


async def _collect(inbox: Inbox) -> list[EngineChunk]:
    out: list[EngineChunk] = []
    while not out or out[-1].finish_reason is None:
        out.extend(await inbox.next())
    return out


def test_interleaved_requests_arrive_in_order_one_frame_per_loop_turn():
    async def main():
        receiver = DeltaReceiver("127.0.0.1")
        sender = DeltaSender()
        inboxes = [receiver.register() for _ in range(20)]
        expected = {key: [_chunk(i, "stop" if i == 9 else None) for i in range(10)] for key, _ in inboxes}
        sender.acquire(receiver.address)
        rng = random.Random(7)
        for step in range(10):  # one "engine step": every request's delta sent in the same loop turn
            keys = [key for key, _ in inboxes]
            rng.shuffle(keys)
            for key in keys:
                sender.send(receiver.address, key, expected[key][step])
            await asyncio.sleep(0)
        got = await asyncio.wait_for(asyncio.gather(*(_collect(inbox) for _, inbox in inboxes)), 10)
        sender.release(receiver.address)
        assert sender.frames_sent == 10  # 200 deltas, one frame per step
        assert {key: g for (key, _), g in zip(inboxes, got)} == expected
        await receiver.aclose()
        sender.close()

    asyncio.run(main())


def test_a_lease_failure_comes_after_the_deltas_before_it():
    async def main():
        inbox = Inbox()
        inbox.put(_chunk(0))
        inbox.fail(RuntimeError("replica died"))
        assert await inbox.next() == [_chunk(0)]
        with pytest.raises(RuntimeError, match="replica died"):
            await inbox.next()

    asyncio.run(main())


def test_a_lease_that_ends_without_the_finishing_delta_fails_after_the_grace(monkeypatch):
    monkeypatch.setattr(delta_channel, "LOST_GRACE_S", 0.05)

    async def main():
        late, lost = Inbox(), Inbox()
        for inbox in (late, lost):
            inbox.put(_chunk(0))
            inbox.lease_ended()
        late.put(_chunk(1, "stop"))  # the last delta arrives after the lease's end: no error
        assert [c.finish_reason for c in await late.next()] == [None, "stop"]
        assert await lost.next() == [_chunk(0)]
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(lost.next(), 5)
        await asyncio.sleep(0.1)
        assert late._error is None

    asyncio.run(main())


def test_deltas_of_closed_requests_and_malformed_frames_are_dropped():
    async def main():
        import zmq

        receiver = DeltaReceiver("127.0.0.1")
        closed, _ = receiver.register()
        key, inbox = receiver.register()
        receiver.unregister(closed)
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.connect(receiver.address)
        raw.send(b"\xc1 not msgpack")
        sender = DeltaSender()
        sender.send(receiver.address, closed, _chunk(0))
        sender.send(receiver.address, key, _chunk(1, "stop"))
        assert await asyncio.wait_for(_collect(inbox), 10) == [_chunk(1, "stop")]
        assert receiver.frames_received == 2
        raw.close(linger=0)
        sender.close()
        await receiver.aclose()

    asyncio.run(main())


def test_an_idle_destination_socket_is_closed(monkeypatch):
    monkeypatch.setattr(delta_channel, "IDLE_CLOSE_S", 0.01)

    async def main():
        sender = DeltaSender()
        sender.acquire("tcp://127.0.0.1:9")
        sender.send("tcp://127.0.0.1:9", 1, _chunk(0))
        await asyncio.sleep(0)
        sender.acquire("tcp://127.0.0.1:9")  # a second request to the same ingress
        sender.release("tcp://127.0.0.1:9")
        await asyncio.sleep(0.05)
        assert sender._sockets  # still in use
        sender.release("tcp://127.0.0.1:9")
        await asyncio.sleep(0.05)
        assert not sender._sockets

    asyncio.run(main())
