"""The engine replica's account of where its first token's time went (vllm_engine.first_chunk_ms)."""

from __future__ import annotations

from types import SimpleNamespace

from serve_app.engine.vllm_engine import first_chunk_ms


def test_first_chunk_ms_splits_the_replica_side_of_the_first_token():
    stats = SimpleNamespace(queued_ts=10.001, scheduled_ts=10.004, first_token_ts=10.054)
    assert first_chunk_ms(10.0, stats, 10.055) == {"handoff": 1.0, "queued": 3.0, "prefill": 50.0, "out": 1.0}
    # A step vLLM did not time is left out, and the next one spans it.
    stats = SimpleNamespace(queued_ts=10.001, scheduled_ts=0.0, first_token_ts=10.054)
    assert first_chunk_ms(10.0, stats, 10.055) == {"handoff": 1.0, "prefill": 53.0, "out": 1.0}
    assert first_chunk_ms(10.0, None, 10.055) is None  # vLLM's stats off
    assert first_chunk_ms(10.0, SimpleNamespace(queued_ts=0.0, scheduled_ts=0.0, first_token_ts=0.0), 10.1) is None
