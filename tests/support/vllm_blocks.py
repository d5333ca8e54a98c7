"""vLLM's own prefix-cache block pool, driven the way its scheduler drives it, for tests of what the router
indexes: `run` caches a request's full blocks (under its tenant's cache salt) and returns the KV events the engine
would publish. A change in how vLLM hashes or reports blocks then fails those tests rather than silently making
the router's hashes miss."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import Request

_fn = get_hash_fn_by_name("sha256")
kv_cache_utils.init_none_hash(_fn)


class BlockPoolEngine:
    def __init__(self, block_size: int, num_blocks: int = 256):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, True, block_size, enable_kv_cache_events=True)
        self._hasher = kv_cache_utils.get_request_block_hasher(block_size, _fn)
        self.n = 0

    def run(self, tokens: list[int], salt: str | None = None) -> tuple[int, list]:
        """(blocks found cached, the events of caching the prompt's full blocks)."""
        self.n += 1
        req = Request(f"r{self.n}", tokens, SamplingParams(max_tokens=1), None, cache_salt=salt,
                      block_hasher=self._hasher)
        cached = 0
        for h in req.block_hashes:
            if not self.pool.get_cached_block(h, [0]):
                break
            cached += 1
        n = len(tokens) // self.block_size
        blocks = [self.pool.get_cached_block(h, [0])[0] for h in req.block_hashes[:cached]]
        blocks += self.pool.get_new_blocks(n - cached)
        self.pool.cache_full_blocks(req, blocks, cached, n, self.block_size, 0)
        return cached, self.pool.take_events()
