"""vLLM KV events -> the router's index: decoding, hash translation, gap detection and replay, the subscriber.

Wire format (vllm/distributed/kv_events.py, ZmqEventPublisher): PUB multipart `(topic, seq as 8-byte big-endian,
msgpack(KVEventBatch))`; the batch is an array `[ts, events, data_parallel_rank]` and each event a map tagged
`"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"`. The replay socket is a ROUTER: send
`(b"", start_seq)` from a DEALER and it streams `(b"", topic, seq, payload)` for every buffered batch with
seq >= start, then `(b"", b"", -1, b"")`.

The engine's own block hashes are opaque to us (sha256 or int, salted per engine); the router indexes its OWN
chained hashes (hashing.py), which the ingress can compute from a prompt. A BlockStored event carries the
blocks' token ids and the engine hash of the parent block, so each replica keeps `engine hash -> our hash` to
chain from the parent and to find the block again when a BlockRemoved names it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import msgspec

from serve_app.routing.hashing import block_hashes
from serve_app.routing.index import EVENTS, PREDICTED

if TYPE_CHECKING:
    from serve_app.routing.core import RouterCore

log = logging.getLogger(__name__)

END_SEQ = -1
REPLAY_TIMEOUT_S = 2.0
RETRY_AFTER_S = 10.0

EngineHash = bytes | int


# Mirrors of vLLM's structs: same tags and field names; defaults everywhere so older/newer publishers that add
# or omit optional fields still decode (unknown fields are ignored by msgspec).
class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def _on_gpu(medium: str | None, group_idx: int | None) -> bool:
    # Offloaded copies (CPU/storage) are not prefix-cache hits on the GPU; hybrid models' other groups are
    # not the full-attention cache the prompt blocks map to.
    return medium in (None, "GPU") and group_idx in (None, 0)


def _is_salt_only(keys: Any) -> bool:
    # Events publish extra keys untagged: a LoRA name (also a str) comes with `lora_name` set, which is not
    # plain anyway; mm keys are pairs and prompt-embeds digests bytes. So a lone str is the cache salt.
    return isinstance(keys, (list, tuple)) and len(keys) == 1 and isinstance(keys[0], str)


class EventTranslator:
    """Applies decoded events of one replica to the core's index, in our hashes."""

    def __init__(self, core: RouterCore, replica_id: str):
        self.core = core
        self.replica_id = replica_id
        self.engine_to_ours: dict[EngineHash, int | None] = {}  # None: a block we cannot index (LoRA/mm)
        self.refs: Counter[int] = Counter()
        self.orphans = 0  # stored blocks whose parent we never saw
        self.events = 0

    def apply(self, batch: KVEventBatch) -> None:
        for ev in batch.events:
            self.events += 1
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                self._removed(ev)
            elif isinstance(ev, AllBlocksCleared):
                self.clear()

    def clear(self) -> None:
        self.engine_to_ours.clear()
        self.refs.clear()
        self.core.blocks_cleared(self.replica_id)

    def _stored(self, ev: BlockStored) -> None:
        if not _on_gpu(ev.medium, ev.group_idx):
            return
        bs = self.core.block_size
        n = len(ev.block_hashes)
        extra = list(ev.extra_keys or ())
        salt = None
        if ev.parent_block_hash is None and extra and _is_salt_only(extra[0]):
            salt = extra[0][0]  # a tenant's cache_salt: vLLM mixes it into the prompt's first block only
            extra[0] = None
        plain = ev.lora_name is None and ev.lora_id is None and not any(extra)
        if ev.parent_block_hash is None:
            parent = None
        else:
            parent = self.engine_to_ours.get(ev.parent_block_hash, -1)
            if parent == -1:
                self.orphans += n
                return
        if parent is None and ev.parent_block_hash is not None:
            plain = False  # child of an unindexable block
        if not plain or ev.block_size != bs or len(ev.token_ids) != n * bs:
            for eh in ev.block_hashes:
                self.engine_to_ours.setdefault(eh, None)
            return
        ours = block_hashes(ev.token_ids, bs, parent=parent, salt=salt)
        mapping = self.engine_to_ours
        refs = self.refs
        for eh, oh in zip(ev.block_hashes, ours):
            if mapping.get(eh) != oh:
                mapping[eh] = oh
                refs[oh] += 1
        self.core.blocks_stored(self.replica_id, ours)  # also a recency touch for blocks reused from cache

    def _removed(self, ev: BlockRemoved) -> None:
        if not _on_gpu(ev.medium, ev.group_idx):
            return
        gone = []
        for eh in ev.block_hashes:
            oh = self.engine_to_ours.pop(eh, None)
            if oh is None:
                continue
            self.refs[oh] -= 1
            if self.refs[oh] <= 0:
                del self.refs[oh]
                gone.append(oh)
        if gone:
            self.core.blocks_removed(self.replica_id, gone)


class ReplicaFeed:
    """Sequence tracking and (optionally) the ZMQ subscriber task of one replica.

    `on_live(seq, payload)` applies an in-order batch, skips a duplicate, and on a gap returns the sequence
    number to replay from (the subscriber does the replay and feeds `on_replay`). Sequence going backwards means
    the engine's publisher restarted: the index is cleared and replayed from 0.
    """

    def __init__(self, core: RouterCore, replica_id: str, endpoint: str | None, replay_endpoint: str | None):
        self.core = core
        self.replica_id = replica_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.translator = EventTranslator(core, replica_id)
        self.last_seq: int | None = None
        self.gaps = 0
        self.resyncs = 0
        self.lost = 0  # gaps the replay buffer no longer covered (index cleared instead)
        self.degraded = False
        self._replaying = False
        self._retry_at = 0.0
        self._dup_floor = 0  # live seqs at or above it but <= last_seq are replay duplicates
        self._task: asyncio.Task | None = None

    # ---- pure state machine ----
    def apply(self, batch: Any, seq: int | None = None) -> None:
        """Apply a batch given directly (decoded struct, vLLM's own struct, or msgpack bytes)."""
        if isinstance(batch, (bytes, bytearray, memoryview)):
            batch = decode_batch(bytes(batch))
        elif not isinstance(batch, KVEventBatch):  # e.g. vllm's KVEventBatch: re-decode through the wire format
            batch = decode_batch(msgspec.msgpack.encode(batch))
        if seq is not None:
            self.last_seq = seq
        self.translator.apply(batch)

    def on_live(self, seq: int, payload: bytes) -> int | None:
        if self.degraded:
            # Predicting now; retry a full replay now and then, ignore live batches in between.
            if time.monotonic() < self._retry_at or not self.replay_endpoint:
                return None
            return 0
        last = self.last_seq
        if last is not None and seq <= last:
            if seq >= self._dup_floor:
                return None  # already applied through a replay
            # Lower than anything a replay delivered: the publisher restarted and counts from 0 again.
            self.translator.clear()
            self.last_seq = last = None
            self.resyncs += 1
        expected = 0 if last is None else last + 1
        if seq != expected:
            self.gaps += 1
            if self.replay_endpoint and not self._replaying:
                return expected
            if last is not None or not self.replay_endpoint:
                self._lose()
        self._accept(seq, payload)
        if not self._replaying:
            self._dup_floor = seq + 1  # only a replay can bring seqs at or below this again
        return None

    def begin_replay(self, start: int) -> None:
        self._replaying = True
        self._dup_floor = start
        if self.degraded:  # back to the engine's truth: drop the predictions first
            self.core.set_mode(self.replica_id, EVENTS)
            self.translator.clear()

    def on_replay(self, start: int, seq: int, payload: bytes) -> None:
        expected = start if self.last_seq is None else self.last_seq + 1
        if seq > expected:
            self._lose()  # the publisher's buffer no longer reaches back to what we missed
        if self.last_seq is None or seq > self.last_seq:
            self._accept(seq, payload)

    def end_replay(self, ok: bool) -> None:
        self._replaying = False
        if ok:
            self.degraded = False
        else:
            self.degrade()
            self._retry_at = time.monotonic() + RETRY_AFTER_S

    def degrade(self) -> None:
        """No trustworthy feed: predict from decisions until a replay succeeds again."""
        self.degraded = True
        self.translator.engine_to_ours.clear()
        self.translator.refs.clear()
        self.last_seq = None
        self.core.set_mode(self.replica_id, PREDICTED)

    def _accept(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            self.translator.apply(decode_batch(payload))
        except msgspec.DecodeError:
            log.warning("undecodable KV event batch %s from replica %s", seq, self.replica_id)

    def _lose(self) -> None:
        # Missed stores would only make us underestimate, but missed removals would make us route to blocks
        # that are gone: forget everything and let new events rebuild the picture.
        self.lost += 1
        self.translator.clear()

    def stats(self) -> dict:
        return {
            "events": self.translator.events,
            "last_seq": self.last_seq,
            "gaps": self.gaps,
            "resyncs": self.resyncs,
            "lost": self.lost,
            "orphans": self.translator.orphans,
            "degraded": self.degraded,
        }

    # ---- the subscriber ----
    def start(self) -> None:
        asyncio.get_running_loop()  # RuntimeError when there is none: the caller falls back to apply()
        if self.endpoint and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events-{self.replica_id}")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        replay = None
        try:
            if self.replay_endpoint:
                replay = self._replay_socket(ctx)
                replay = await self._replay(ctx, replay, 0)  # catch up on what happened before we connected
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                start = self.on_live(seq, frames[2])
                if start is not None and replay is not None:
                    self.resyncs += 1
                    replay = await self._replay(ctx, replay, start)
                    if not self.degraded:
                        self.on_live(seq, frames[2])  # a no-op when the replay already covered it
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - a broken feed degrades to prediction rather than killing the Router
            log.exception("KV event subscriber for replica %s failed; predicting instead", self.replica_id)
            self.degrade()
        finally:
            sub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _replay_socket(self, ctx):
        import zmq

        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        return sock

    async def _replay(self, ctx, sock, start: int):
        """Ask for every buffered batch from `start`; returns the socket to use next (a fresh one on timeout)."""
        self.begin_replay(start)
        await sock.send_multipart((b"", start.to_bytes(8, "big")))
        try:
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), REPLAY_TIMEOUT_S)
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    break
                self.on_replay(start, seq, frames[3])
        except asyncio.TimeoutError:
            # No replay service answering: predict until a later replay works. A fresh socket, so that late
            # replies cannot be mistaken for the next answer.
            log.warning("KV event replay from replica %s timed out; predicting", self.replica_id)
            self.end_replay(ok=False)
            sock.close(linger=0)
            return self._replay_socket(ctx)
        self.end_replay(ok=True)
        return sock


class KvFeeds:
    """The KV event feeds of one engine deployment's replicas, feeding one RouterCore.

    Owned by the Router deployment, so the core stays free of sockets and tasks: `register` (re)starts a
    replica's subscriber (call it on the event loop that will run it), `apply` takes a batch given directly (tests,
    or without a loop), `retain` stops the feeds of replicas the core no longer knows.
    """

    def __init__(self, core: RouterCore, enabled: bool = True):
        self.core = core
        self.enabled = enabled  # the Serve config's `router.kv_events`
        self.feeds: dict[str, ReplicaFeed] = {}

    def register(self, replica_id: str, events_endpoint: str | None = None, replay_endpoint: str | None = None,
                 block_size: int | None = None) -> None:
        self._stop(replica_id)
        events = bool(events_endpoint and self.enabled)
        self.core.register_replica(replica_id, block_size, events=events)
        if not events:
            return
        feed = self.feeds[replica_id] = ReplicaFeed(self.core, replica_id, events_endpoint, replay_endpoint)
        try:
            feed.start()
        except RuntimeError:  # no running loop: events can still be pushed through apply
            log.info("no event loop; replica %s takes events through apply only", replica_id)

    def apply(self, replica_id: str, batch: Any, seq: int | None = None) -> None:
        """Apply one vLLM KVEventBatch (decoded, vLLM's own struct, or msgpack bytes) from `replica_id`'s engine."""
        self.core.ensure_replica(replica_id)
        feed = self.feeds.get(replica_id)
        if feed is None:
            feed = self.feeds[replica_id] = ReplicaFeed(self.core, replica_id, None, None)
            self.core.set_mode(replica_id, EVENTS)
        feed.apply(batch, seq)

    def retain(self) -> None:
        """Stop the feeds of replicas the core has forgotten (removed or dead)."""
        for rid in [r for r in self.feeds if r not in self.core.loads]:
            self._stop(rid)

    def stats(self) -> dict[str, dict]:
        return {rid: feed.stats() for rid, feed in self.feeds.items()}

    def metrics(self) -> dict:
        return self.core.metrics(self.stats())

    def _stop(self, replica_id: str) -> None:
        feed = self.feeds.pop(replica_id, None)
        if feed is not None:
            feed.stop()

    async def close(self) -> None:
        for rid in list(self.feeds):
            self._stop(rid)
        await asyncio.sleep(0)
