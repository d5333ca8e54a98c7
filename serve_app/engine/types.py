"""What crosses between the ingress and an engine replica: plain data, light to import (no vLLM, no Ray)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class EngineRequest:
    """What the ingress sends to an engine replica (plain data: it crosses a Ray boundary)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    priority: int = 0
    skip_special_tokens: bool = True
    forced_token_ids: list[int] | None = None
    forced_eos_id: int | None = None
    target_replica: str | None = None  # the router's choice, honoured by the Serve request router
    # The replica holding the request's routing reservation (ingress bookkeeping, ingress/clients.py: a request
    # another replica takes moves it there); None without a decision. Engines do not read it.
    reserved_on: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # vLLM StructuredOutputsParams fields, e.g. {"json": schema} or {"json_object": True}; None = free text
    structured: dict[str, Any] | None = None
    # (ingress address, key): stream the deltas over the delta channel (engine/delta_channel.py), not the call
    reply_to: tuple[str, int] | None = None
    # The tenant's prefix-cache namespace (vLLM mixes it into the first block's hash): no cached tokens across
    # tenants that do not share one. None = the shared, unsalted cache.
    cache_salt: str | None = None
    # Whose share of the engine's queue the request takes (engine/fair_share.py): its tenant; None = no one's
    # (a speculative warm-up, or `ingress.fair_share` off), and then arrival orders it within its priority. During
    # a rolling upgrade an ingress of the version before sends requests without it, and unpickled, its slot is unset.
    tenant: str | None = None
    share: int = 1  # the tenant's weight in those shares (TenantConfig.share); unset like `tenant` in an upgrade


@dataclass(slots=True)
class EngineChunk:
    """One streamed step: the new text and token ids since the previous chunk."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop string that ended generation, if any
    num_cached_tokens: int | None = None  # set on the first chunk
    error: str | None = None
    # Set on the first chunk: where its time went inside the engine replica (engine/vllm_engine.py,
    # `first_chunk_ms`), in milliseconds: durations, so they hold across hosts whose clocks differ.
    engine_ms: dict[str, float] | None = None
    # Set on an Engine deployment's acceptance chunk: the replica that took the request (ingress/clients.py).
    replica: str | None = None


def merge_chunks(chunks: list[EngineChunk]) -> EngineChunk:
    """Consecutive chunks of one request as one: texts and token ids joined, the cache report from the first
    that has it, the end (finish, stop reason, error) from the last."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    return EngineChunk(
        text="".join(c.text for c in chunks),
        token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=last.finish_reason,
        stop_reason=last.stop_reason,
        num_cached_tokens=next((c.num_cached_tokens for c in chunks if c.num_cached_tokens is not None), None),
        error=last.error,
        engine_ms=next((c.engine_ms for c in chunks if c.engine_ms is not None), None),
    )
