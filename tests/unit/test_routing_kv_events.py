"""KV events: vLLM's own event structs and encoder/publisher -> our index (store, remove, clear, gap -> resync)."""

import asyncio

import msgspec
import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from serve_app.routing.core import RouteRequest, RouterCore
from serve_app.routing.hashing import block_hashes
from serve_app.routing.index import EVENTS
from serve_app.routing.kv_events import KvFeeds, ReplicaFeed, decode_batch
from tests.support.aio import free_port, until

BS = 4
TOKENS = list(range(100, 124))  # 6 blocks
OURS = block_hashes(TOKENS, BS)
ENC = msgspec.msgpack.Encoder()  # what ZmqEventPublisher uses


def stored(engine_hashes, parent, token_ids, medium="GPU"):
    return BlockStored(block_hashes=engine_hashes, parent_block_hash=parent, token_ids=token_ids, block_size=BS,
                       lora_id=None, medium=medium, lora_name=None)


def removed(engine_hashes):
    return BlockRemoved(block_hashes=engine_hashes, medium="GPU")


def payload(*events):
    return ENC.encode(KVEventBatch(ts=1.0, events=list(events)))


def new_core():
    c = RouterCore("kv", BS, seed=0)
    c.sync_replicas(["r"])
    c.feeds = KvFeeds(c)  # the Router deployment's side: the core itself owns no feed
    return c


def blocks(c):
    return set(c.index.replicas["r"].blocks)


def test_decodes_vllms_wire_format():
    batch = decode_batch(payload(stored([b"e0"], None, TOKENS[:4]), removed([7]), AllBlocksCleared()))
    kinds = [type(e).__name__ for e in batch.events]
    assert kinds == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert batch.events[0].token_ids == TOKENS[:4] and batch.events[1].block_hashes == [7]


def test_stored_blocks_get_our_chained_hashes_across_events():
    c = new_core()
    c.feeds.apply("r", payload(stored([b"e0", b"e1"], None, TOKENS[:8])), seq=0)
    c.feeds.apply("r", payload(stored([11, 12], b"e1", TOKENS[8:16])), seq=1)  # chained from the parent
    assert blocks(c) == set(OURS[:4])
    assert c.index.replicas["r"].mode == EVENTS
    assert c.choose(RouteRequest("q", OURS, len(TOKENS))).cached_blocks == 4


def test_removed_and_cleared():
    c = new_core()
    c.feeds.apply("r", payload(stored([1, 2, 3], None, TOKENS[:12])))
    c.feeds.apply("r", payload(removed([3])))
    assert blocks(c) == set(OURS[:2])
    c.feeds.apply("r", payload(AllBlocksCleared()))
    assert blocks(c) == set()


def test_block_stored_twice_survives_one_removal_of_its_other_engine_hash():
    c = new_core()
    c.feeds.apply("r", payload(stored([1], None, TOKENS[:4]), stored([9], None, TOKENS[:4])))
    c.feeds.apply("r", payload(removed([1])))
    assert blocks(c) == {OURS[0]}


def test_orphans_offloaded_and_lora_blocks_are_not_indexed():
    c = new_core()
    lora = stored([5], None, TOKENS[:4])
    lora.lora_name = "adapter"
    c.feeds.apply("r", payload(stored([1], b"unknown-parent", TOKENS[:4]), stored([2], None, TOKENS[:4], "CPU"),
                                lora))
    assert blocks(c) == set()
    assert c.feeds.feeds["r"].stats()["orphans"] == 1


def test_accepts_vllm_struct_directly():
    c = new_core()
    c.feeds.apply("r", KVEventBatch(ts=0.0, events=[stored([1], None, TOKENS[:4])]))
    assert blocks(c) == {OURS[0]}


def test_gap_asks_for_replay_and_replay_fills_it():
    c = new_core()
    feed = ReplicaFeed(c, "r", "tcp://x", "tcp://y")
    c.feeds.feeds["r"] = feed
    c.set_mode("r", EVENTS)
    msgs = [payload(stored([i], i - 1 if i else None, TOKENS[4 * i : 4 * i + 4])) for i in range(4)]
    assert feed.on_live(0, msgs[0]) is None
    assert feed.on_live(3, msgs[3]) == 1  # seqs 1 and 2 were lost
    feed.begin_replay(1)
    for s in (1, 2, 3):
        feed.on_replay(1, s, msgs[s])
    feed.end_replay(ok=True)
    assert feed.on_live(3, msgs[3]) is None and feed.last_seq == 3
    assert blocks(c) == set(OURS[:4])
    assert feed.stats()["gaps"] == 1 and feed.stats()["lost"] == 0


def test_replay_that_no_longer_covers_the_gap_clears_the_index():
    c = new_core()
    feed = ReplicaFeed(c, "r", "tcp://x", "tcp://y")
    c.feeds.feeds["r"] = feed
    feed.on_live(0, payload(stored([0], None, TOKENS[:4])))
    assert feed.on_live(9, payload()) == 1
    feed.begin_replay(1)
    feed.on_replay(1, 5, payload(stored([50], None, TOKENS[4:8])))  # the buffer starts after what we missed
    feed.end_replay(ok=True)
    assert feed.stats()["lost"] == 1
    assert blocks(c) == set(block_hashes(TOKENS[4:8], BS))


def test_failed_replay_degrades_to_prediction():
    c = new_core()
    feed = ReplicaFeed(c, "r", "tcp://x", "tcp://y")
    c.feeds.feeds["r"] = feed
    c.set_mode("r", EVENTS)
    feed.begin_replay(0)
    feed.end_replay(ok=False)
    m = c.feeds.metrics()["replicas"]["r"]
    assert m["mode"] == "predicted" and m["degraded"] is True


def test_publisher_restart_resets_the_index():
    c = new_core()
    feed = ReplicaFeed(c, "r", "tcp://x", None)
    c.feeds.feeds["r"] = feed
    for s in range(3):
        feed.on_live(s, payload(stored([s], s - 1 if s else None, TOKENS[4 * s : 4 * s + 4])))
    feed.on_live(0, payload(stored([100], None, TOKENS[8:12])))  # counts from 0 again: a new engine
    assert blocks(c) == set(block_hashes(TOKENS[8:12], BS))


@pytest.mark.asyncio
async def test_subscriber_against_vllms_zmq_publisher_with_replay_and_gap():
    port, replay_port = free_port(), free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}")
    c = new_core()
    try:
        # Published before the router connects: only the replay socket can deliver it.
        pub.publish(KVEventBatch(ts=0.0, events=[stored([b"h0", b"h1"], None, TOKENS[:8])]))
        await asyncio.sleep(0.2)
        c.feeds.register("r", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", BS)
        await until(lambda: blocks(c) == set(OURS[:2]))
        # Live events, until the subscription is certainly up.
        pub.publish(KVEventBatch(ts=1.0, events=[stored([b"h2"], b"h1", TOKENS[8:12])]))
        await until(lambda: OURS[2] in blocks(c))
        # Lose two batches on our side, then the next live one reveals the gap and replay refills them.
        feed = c.feeds.feeds["r"]
        pub.publish(KVEventBatch(ts=2.0, events=[stored([b"h3"], b"h2", TOKENS[12:16])]))
        await until(lambda: feed.last_seq == 2)
        feed.last_seq = 0
        c.blocks_removed("r", [OURS[2], OURS[3]])
        pub.publish(KVEventBatch(ts=3.0, events=[removed([b"h0"])]))
        await until(lambda: feed.last_seq == 3)
        assert blocks(c) == {OURS[1], OURS[2], OURS[3]}
        assert feed.stats()["gaps"] == 1 and feed.stats()["resyncs"] >= 1
    finally:
        await c.feeds.close()
        pub.shutdown()
