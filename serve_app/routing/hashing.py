"""Chained block hashes of prompt token ids, one per FULL block of the engine's block size.

`h[i] = hash((h[i-1], *tokens[i*B:(i+1)*B]))` with `h[-1] = SEED`: equal hashes at block i mean equal first
(i+1)*B tokens, which is exactly what vLLM's prefix cache can reuse (it caches full blocks only; the partial tail
is never a hit). Python's tuple-of-int hash is 64-bit and, unlike str/bytes hashing, not salted per process, so
the ingress, the Router and the KV-event translator (all on the same interpreter) agree on every value. It runs
in C: about 5 ms for 100K tokens at block size 16, under 1 ms at 128 (see load/bench_router.py).

A tenant's `cache_salt` (vLLM mixes it into the FIRST block's hash only, `kv_cache_utils.
generate_block_hash_extra_keys`) starts the chain from `salted_seed(salt)` instead of SEED: every block of a salted
prompt then differs from the same tokens unsalted or under another salt, exactly as in the engine's cache, and
the KV-event translator, which sees the salt in the first block's `extra_keys`, chains from the same seed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

SEED = 0x9E3779B97F4A7C15 & ((1 << 61) - 1)  # any fixed int; distinguishes "no parent" from a real hash


def salted_seed(salt: str | None) -> int:
    """The chain's start for a prompt under `salt` (None or "" = unsalted, as vLLM treats them)."""
    if not salt:
        return SEED
    # str hashing is randomised per process, so the salt goes through a fixed digest to a plain int first.
    digest = int.from_bytes(hashlib.blake2b(salt.encode("utf-8"), digest_size=8).digest(), "big")
    return hash((SEED, digest))


def block_hashes(
    token_ids: Sequence[int], block_size: int, *, parent: int | None = None, salt: str | None = None
) -> list[int]:
    """Hashes of every full block of `token_ids`, chained from `parent` (None = start of the prompt, under
    `salt` when given; a salt only matters at the start, like vLLM's)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    h = salted_seed(salt) if parent is None else parent
    out: list[int] = []
    append = out.append
    end = len(token_ids) - len(token_ids) % block_size
    for start in range(0, end, block_size):
        h = hash((h, *token_ids[start : start + block_size]))
        append(h)
    return out


def extend_block_hashes(
    prev: list[int], token_ids: Sequence[int], block_size: int, *, salt: str | None = None
) -> list[int]:
    """Hashes of `token_ids` reusing `prev`, the hashes of an earlier prompt that `token_ids` extends.

    Agent turns grow by appending; only the new blocks are hashed. The caller guarantees the prefix is unchanged
    (the prompt-stability property the ingress already tests).
    """
    done = min(len(prev), len(token_ids) // block_size)
    if done == 0:
        return block_hashes(token_ids, block_size, salt=salt)
    tail = block_hashes(token_ids[done * block_size :], block_size, parent=prev[done - 1])
    return prev[:done] + tail
