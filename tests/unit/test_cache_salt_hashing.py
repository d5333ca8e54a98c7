"""A tenant's cache salt in the router's block hashes: the same blocks as vLLM's salted prefix cache.

The events come from vLLM's own BlockPool (the code that publishes them in the engine; tests/support/vllm_blocks.py), so a change in how vLLM
reports the salt fails here rather than silently making every salted block unindexable.
"""

from hypothesis import given
from hypothesis import strategies as st

from serve_app.routing.core import RouterCore
from serve_app.routing.kv_events import KvFeeds
from serve_app.routing.types import RouteRequest
from serve_app.routing.hashing import block_hashes, extend_block_hashes
from tests.support.vllm_blocks import BlockPoolEngine

BS = 4
TOKENS = list(range(100, 124))  # 6 blocks


def core_fed(engine_events):
    from vllm.distributed.kv_events import KVEventBatch

    c = RouterCore("kv", BS, seed=0)
    c.sync_replicas(["r"])
    feeds = KvFeeds(c)  # the Router deployment's side: the core itself owns no feed
    for i, evs in enumerate(engine_events):
        feeds.apply("r", KVEventBatch(ts=0.0, events=evs), seq=i)
    return c


def cached_blocks(core, tokens, salt=None):
    return core.choose(RouteRequest("q", block_hashes(tokens, BS, salt=salt), len(tokens))).cached_blocks


def test_salted_events_index_exactly_the_salted_hashes():
    eng = BlockPoolEngine(BS)
    _, evs = eng.run(TOKENS, salt="tenant:a")
    assert evs[0].extra_keys[0] == ("tenant:a",)  # what the translator relies on
    core = core_fed([evs])
    assert set(core.index.replicas["r"].blocks) == set(block_hashes(TOKENS, BS, salt="tenant:a"))
    assert cached_blocks(core, TOKENS, "tenant:a") == 6
    assert cached_blocks(core, TOKENS, "tenant:b") == 0
    assert cached_blocks(core, TOKENS) == 0


def test_router_and_engine_agree_on_hits_across_tenants_and_continuations():
    eng = BlockPoolEngine(BS)
    batches = []
    for tokens, salt in [(TOKENS[:12], "tenant:a"), (TOKENS, "tenant:a"), (TOKENS, None), (TOKENS[:8], "tenant:b")]:
        predicted = cached_blocks(core_fed(batches), tokens, salt) if batches else 0
        engine_cached, evs = eng.run(tokens, salt)
        assert predicted == engine_cached, (tokens, salt)
        batches.append(evs)
    # The second tenant-a prompt continued from a cached parent (no salt in its event): still indexed.
    assert cached_blocks(core_fed(batches), TOKENS, "tenant:a") == 6


tokens = st.lists(st.integers(0, 50_000), min_size=BS, max_size=64)


@given(tokens, st.text(min_size=1, max_size=20), st.text(min_size=1, max_size=20))
def test_salts_share_no_block(toks, s1, s2):
    a, b, plain = block_hashes(toks, BS, salt=s1), block_hashes(toks, BS, salt=s2), block_hashes(toks, BS)
    assert not set(a) & set(plain)
    if s1 != s2:
        assert not set(a) & set(b)
    assert block_hashes(toks, BS, salt="") == plain  # vLLM treats an empty salt as none


@given(tokens, tokens, st.text(min_size=1, max_size=8))
def test_extend_keeps_the_salt(a, more, salt):
    prev = block_hashes(a, BS, salt=salt)
    assert extend_block_hashes(prev, a + more, BS, salt=salt) == block_hashes(a + more, BS, salt=salt)
