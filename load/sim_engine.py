"""A simulated engine replica that schedules like vLLM's V1 engine, for the router simulation (load/sim_router.py).

What it models, and why each part matters to routing:
- **Continuous batching with a per-step token budget.** Every step, each running request that is decoding gets
  one token, requests still prefilling get chunks of what is left of the budget (chunked prefill), then waiting
  requests are admitted first-come first-served while budget, sequence slots and KV memory last. A request's TTFT
  is therefore the prefill queued ahead of it on its replica plus its own uncached prefill, with decodes
  interleaved, not "everything before it, decodes included" as a one-request-at-a-time server would have it.
- **Step time** = a fixed overhead + prefill tokens / prefill rate + decoding sequences x per-sequence cost:
  weights are read once per step, prefill is compute-bound, each decoding sequence adds its KV reads.
  Attention's growth with context length is not modelled (a long prompt costs the same per token as a short one).
- **A paged KV cache with prefix caching** (`KvBlockPool`): blocks in use by running requests cannot be evicted;
  a finished request's blocks become free-but-cached and are evicted least-recently-freed first, its tail blocks
  before its head (vLLM frees them in reverse order so that a reusable leading run survives longest). A computed
  block becomes reusable (and is announced as a KV event) at the end of the step that computed it. Admission
  reserves the prompt's and the output's blocks up front; a request that does not fit waits, blocking those
  behind it, instead of being preempted.
- **Priority scheduling** (vLLM's `scheduling_policy: priority`): waiting requests are admitted in order of
  (priority, arrival), lower first; admitted ones keep their place in the batch. With one priority it is FCFS.
- **Pure decode stretches are fast-forwarded**: when no prefill is scheduled the batch does not change until a
  request finishes or arrives, so those steps are advanced in one jump (an arrival splits the jump at the step
  in progress).

Block hashes are the trace's `hash_ids` (512-token blocks; the last one may be partial, and counts as the trace
defines it: an equal id is a reusable block).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

TRACE_BLOCK = 512


@dataclass(slots=True)
class EngineParams:
    prefill_tps: float = 10_000.0  # prefill tokens per second of step time
    step_overhead_s: float = 0.010  # per step, whatever it holds (weights read, scheduling, launch)
    decode_seq_s: float = 0.00025  # per decoding sequence per step (its KV reads)
    step_tokens: int = 8192  # vLLM max_num_batched_tokens
    max_seqs: int = 256  # vLLM max_num_seqs
    cache_blocks: int = 8192  # KV cache size in 512-token blocks

    def step_s(self, prefill_tokens: int, decoding: int) -> float:
        return self.step_overhead_s + prefill_tokens / self.prefill_tps + decoding * self.decode_seq_s


@dataclass(slots=True, eq=False)
class SimRequest:
    id: str
    arrival: float
    hashes: list[int]
    n_in: int
    n_out: int
    hit: int = 0  # prompt tokens found cached at admission
    done: int = 0  # prompt tokens computed or cached so far
    next_block: int = 0  # first block not yet hashed into the cache
    held: list[int] = field(default_factory=list)  # cached blocks this request holds a reference on
    anon: int = 0  # its blocks outside the cache map: not yet computed, duplicates, output
    first_token_at: float | None = None
    priority: int = 0  # vLLM's: lower is admitted first


class KvBlockPool:
    """One replica's KV blocks: referenced by running requests, or free-but-cached in eviction order."""

    def __init__(self, capacity: int, on_stored: Callable[[list[int]], None] | None = None,
                 on_removed: Callable[[list[int]], None] | None = None):
        self.capacity = capacity
        self.ref: dict[int, int] = {}  # cached block -> running requests holding it
        self.free: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; front = evicted next
        self.anon = 0  # physical blocks in use that are not (yet) in the cache map
        self.on_stored = on_stored
        self.on_removed = on_removed

    def leading_hits(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.ref and h not in self.free:
                break
            n += 1
        return n

    def fits(self, new_blocks: int) -> bool:
        in_use = len(self.ref) + self.anon
        # A request larger than the whole cache still runs when it is alone (its blocks then overcommit).
        return in_use + new_blocks <= self.capacity or in_use == 0

    def admit(self, req: SimRequest, hit_blocks: int, out_blocks: int) -> None:
        for h in req.hashes[:hit_blocks]:  # referenced first, so that making room cannot evict them
            if h in self.free:
                del self.free[h]
                self.ref[h] = 1
            else:
                self.ref[h] += 1
            req.held.append(h)
        new = len(req.hashes) - hit_blocks + out_blocks
        over = len(self.ref) + len(self.free) + self.anon + new - self.capacity
        if over > 0:
            evicted = [self.free.popitem(last=False)[0] for _ in range(min(over, len(self.free)))]
            if evicted and self.on_removed:
                self.on_removed(evicted)
        self.anon += new
        req.anon = new
        req.next_block = hit_blocks

    def computed(self, req: SimRequest) -> None:
        """Hash the request's blocks its prefill has now completed into the cache."""
        stored = []
        while req.next_block < len(req.hashes) and min((req.next_block + 1) * TRACE_BLOCK, req.n_in) <= req.done:
            h = req.hashes[req.next_block]
            req.next_block += 1
            if h in self.ref or h in self.free:
                continue  # computed concurrently elsewhere: vLLM keeps its copy private (stays anonymous)
            self.ref[h] = 1
            self.anon -= 1
            req.anon -= 1
            req.held.append(h)
            stored.append(h)
        if stored and self.on_stored:
            self.on_stored(stored)

    def release(self, req: SimRequest) -> None:
        self.anon -= req.anon
        req.anon = 0
        for h in reversed(req.held):  # tail first: evicted first
            c = self.ref[h] - 1
            if c:
                self.ref[h] = c
            else:
                del self.ref[h]
                self.free[h] = None
        req.held.clear()


class EngineReplica:
    """One engine: a waiting queue, a running batch, a KV pool; advanced one step (or one decode jump) at a time.

    The owner (the simulation) calls `arrive` and, when `next_event` comes due, `advance`; `advance` reports
    first tokens and finishes through the callbacks.
    """

    def __init__(self, rid: str, params: EngineParams, *, on_first_token: Callable[[SimRequest, float], None],
                 on_finish: Callable[[SimRequest, float], None], on_stored=None, on_removed=None):
        self.rid = rid
        self.p = params
        self.pool = KvBlockPool(params.cache_blocks, on_stored, on_removed)
        self.waiting: list[tuple[int, int, SimRequest]] = []  # heap of (priority, arrival order, request)
        self.prefilling: list[SimRequest] = []  # admitted, prompt not finished
        self.decoding: list[tuple[int, int, SimRequest]] = []  # heap of (finish step, seq, request)
        self.step_no = 0  # steps completed; a decoding request emits one token per step
        self.busy_s = 0.0
        self.prefill_computed = 0  # uncached prompt tokens computed here
        self.prompt_routed = 0
        self._seq = 0
        # The step in progress: when it ends, what it computes, and (for a decode jump) how many steps it spans.
        self.step_start = 0.0
        self.step_end: float | None = None
        self.step_chunks: list[tuple[SimRequest, int]] = []
        self.jump_steps = 1
        self.jump_step_s = 0.0
        self.on_first_token = on_first_token
        self.on_finish = on_finish

    @property
    def next_event(self) -> float | None:
        return self.step_end

    def arrive(self, req: SimRequest, now: float) -> None:
        self._seq += 1
        heapq.heappush(self.waiting, (req.priority, self._seq, req))
        self.prompt_routed += req.n_in
        if self.step_end is None:
            self._schedule(now)
        elif self.jump_steps > 1:
            self._split_jump(now)

    def _split_jump(self, now: float) -> None:
        """A decode jump is in progress: stop it at the end of the step running at `now`."""
        done = min(int((now - self.step_start) / self.jump_step_s), self.jump_steps - 1)
        self.step_no += done
        self.busy_s += done * self.jump_step_s
        self.step_start += done * self.jump_step_s
        self.step_end = self.step_start + self.jump_step_s
        self.jump_steps = 1

    def _schedule(self, now: float) -> None:
        """Compose the next step (vLLM V1 order: running decodes, running prefills, then waiting admissions)."""
        p = self.p
        decoding = len(self.decoding)
        budget = max(0, p.step_tokens - decoding)
        chunks = []
        for req in self.prefilling:
            if budget <= 0:
                break
            c = min(req.n_in - req.done, budget)
            chunks.append((req, c))
            budget -= c
        pool = self.pool
        while budget > 0 and self.waiting and len(self.prefilling) + decoding < p.max_seqs:
            req = self.waiting[0][2]
            k = pool.leading_hits(req.hashes)
            out_blocks = math.ceil(req.n_out / TRACE_BLOCK)
            if not pool.fits(len(req.hashes) - k + out_blocks):
                break  # in order: the head waits for memory, and so does everyone behind it
            heapq.heappop(self.waiting)
            pool.admit(req, k, out_blocks)
            req.hit = min(k * TRACE_BLOCK, req.n_in - 1)  # the last prompt token is always computed
            req.done = req.hit
            self.prefill_computed += req.n_in - req.hit
            self.prefilling.append(req)
            c = min(req.n_in - req.done, budget)
            chunks.append((req, c))
            budget -= c
        prefill_tokens = sum(c for _, c in chunks)
        if not chunks and not decoding:
            self.step_end = None
            return
        step_s = p.step_s(prefill_tokens, decoding)
        self.step_start = now
        self.step_chunks = chunks
        self.jump_step_s = step_s
        self.jump_steps = 1
        if not chunks:  # pure decode: nothing changes until the next request finishes (or one arrives)
            self.jump_steps = max(1, self.decoding[0][0] - self.step_no)
        self.step_end = now + step_s * self.jump_steps

    def advance(self) -> None:
        """Finish the step (or decode jump) that ends at `next_event`, report what it produced, start the next."""
        now = self.step_end
        self.busy_s += now - self.step_start
        self.step_no += self.jump_steps
        for req, c in self.step_chunks:
            req.done += c
            self.pool.computed(req)
            if req.done >= req.n_in:
                self.prefilling.remove(req)
                req.first_token_at = now
                self.on_first_token(req, now)
                # The first output token came out of this step; the rest come one per step.
                self._seq += 1
                heapq.heappush(self.decoding, (self.step_no + req.n_out - 1, self._seq, req))
        self.step_chunks = []
        while self.decoding and self.decoding[0][0] <= self.step_no:
            req = heapq.heappop(self.decoding)[2]
            self.pool.release(req)
            self.on_finish(req, now)
        self._schedule(now)
