"""Which blocks each engine replica holds, and how many leading blocks of a prompt it can reuse.

One `ReplicaBlocks` per replica: an insertion-ordered dict of chained block hashes whose order is the recency
order (a touch moves a hash to the end), so TTL expiry and the size cap pop from the front in O(1) each.
Lookup walks the prompt's hashes from the first and stops at the first miss, so it costs O(matched blocks) per
replica, independent of how many blocks are indexed.

Two modes per replica, visible in metrics:
- "events": the engine's KV events are the truth (stored/removed/cleared); no TTL, a safety cap only.
- "predicted": no (healthy) event feed; the router records the prompts it sent there and forgets them after a TTL
  or beyond a size cap, like Dynamo's approximate mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

EVENTS = "events"
PREDICTED = "predicted"


class ReplicaBlocks:
    __slots__ = ("blocks", "mode", "ttl_s", "max_blocks", "evicted")

    def __init__(self, mode: str = PREDICTED, ttl_s: float = 120.0, max_blocks: int = 200_000):
        self.blocks: dict[int, float] = {}  # hash -> last touch (monotonic seconds)
        self.mode = mode
        self.ttl_s = ttl_s
        self.max_blocks = max_blocks
        self.evicted = 0  # dropped by TTL or cap (prediction), for metrics

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, h: int) -> bool:
        return h in self.blocks

    def add(self, hashes: Iterable[int], now: float) -> None:
        blocks = self.blocks
        for h in hashes:
            if h in blocks:
                del blocks[h]  # re-insert at the end: most recently used
            blocks[h] = now
        self._cap()

    def remove(self, hashes: Iterable[int]) -> None:
        blocks = self.blocks
        for h in hashes:
            blocks.pop(h, None)

    def clear(self) -> None:
        self.blocks.clear()

    def expire(self, now: float) -> None:
        """Drop predicted blocks untouched for longer than the TTL (events mode keeps what the engine reports)."""
        if self.mode != PREDICTED:
            return
        blocks = self.blocks
        cutoff = now - self.ttl_s
        while blocks:
            h = next(iter(blocks))
            if blocks[h] > cutoff:
                break
            del blocks[h]
            self.evicted += 1

    def _cap(self) -> None:
        blocks = self.blocks
        excess = len(blocks) - self.max_blocks
        if excess > 0:
            for h in list(islice(blocks, excess)):  # the oldest
                del blocks[h]
            self.evicted += excess

    def overlap(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` held here (a prefix cache can only reuse a leading run)."""
        blocks = self.blocks
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n


class KvIndex:
    """The per-replica block sets of one engine deployment."""

    def __init__(self, ttl_s: float = 120.0, max_predicted_blocks: int = 200_000, max_event_blocks: int = 4_000_000):
        self.ttl_s = ttl_s
        self.max_predicted_blocks = max_predicted_blocks
        self.max_event_blocks = max_event_blocks
        self.replicas: dict[str, ReplicaBlocks] = {}

    def ensure(self, rid: str) -> ReplicaBlocks:
        rb = self.replicas.get(rid)
        if rb is None:
            rb = ReplicaBlocks(PREDICTED, self.ttl_s, self.max_predicted_blocks)
            self.replicas[rid] = rb
        return rb

    def set_mode(self, rid: str, mode: str) -> None:
        """Switch a replica between event-fed and predicted; what was known under the other mode is dropped."""
        rb = self.ensure(rid)
        if rb.mode != mode:
            rb.clear()
            rb.mode = mode
            rb.max_blocks = self.max_event_blocks if mode == EVENTS else self.max_predicted_blocks

    def drop(self, rid: str) -> None:
        self.replicas.pop(rid, None)

    def overlaps(self, hashes: Sequence[int], candidates: Iterable[str], now: float) -> dict[str, int]:
        out = {}
        for rid in candidates:
            rb = self.replicas.get(rid)
            if rb is None:
                out[rid] = 0
                continue
            rb.expire(now)
            out[rid] = rb.overlap(hashes)
        return out

    def total_blocks(self) -> int:
        return sum(len(rb) for rb in self.replicas.values())
