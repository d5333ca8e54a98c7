"""Block hashing: one hash per full block, chained, agreeing with vLLM's own prefix-cache block boundaries."""

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

from serve_app.routing.hashing import block_hashes, extend_block_hashes

tokens = st.lists(st.integers(min_value=0, max_value=200_000), max_size=300)


def _vllm_chain(token_ids, block_size):
    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    out, parent = [], None
    for start in range(0, len(token_ids) - len(token_ids) % block_size, block_size):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, token_ids[start : start + block_size])
        out.append(parent)
    return out


def _common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@given(tokens, st.sampled_from([1, 3, 16, 128]))
def test_one_hash_per_full_block(toks, bs):
    assert len(block_hashes(toks, bs)) == len(toks) // bs


@settings(max_examples=60, deadline=None)
@given(tokens, tokens, st.integers(0, 300), st.sampled_from([4, 16]))
def test_matching_blocks_equal_vllm_engine_blocks(a, tail, cut, bs):
    """Two prompts share k of our hashes exactly when they share k of vLLM's prefix-cache block hashes."""
    b = a[: min(cut, len(a))] + tail
    ours = _common_prefix(block_hashes(a, bs), block_hashes(b, bs))
    engine = _common_prefix(_vllm_chain(a, bs), _vllm_chain(b, bs))
    assert ours == engine
    assert ours == _common_prefix(a, b) // bs


def test_a_changed_early_token_changes_every_later_hash():
    a = list(range(64))
    b = [999] + a[1:]
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert all(x != y for x, y in zip(ha, hb))


def test_same_block_content_at_another_position_hashes_differently():
    block = list(range(16))
    h = block_hashes(block + block, 16)
    assert h[0] != h[1]


@given(tokens, tokens, st.sampled_from([2, 16]))
def test_extend_equals_hashing_from_scratch(a, more, bs):
    assert extend_block_hashes(block_hashes(a, bs), a + more, bs) == block_hashes(a + more, bs)


def test_chaining_from_a_parent_continues_the_chain():
    toks = list(range(100))
    full = block_hashes(toks, 10)
    assert block_hashes(toks[40:], 10, parent=full[3]) == full[4:]
