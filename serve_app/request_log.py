"""The request log: one JSON line per request on stdout, for an operator to find any request by its id.

Fields: ts, request_id, tenant, api, model, prompt_tokens, cached_tokens, output_tokens, ttft_s, duration_s,
finish_reason, replica (the one that ran it: Serve's own pick or a handover may differ from the Router's),
route (the policy that chose a replica, or why there was no choice), predicted_cached
(the router's belief), phases_ms (milliseconds each step before the first token took, from the request's arrival:
http (ASGI entry to the route), parse, render, tenant, route, accept, first_token, then first_frame (the first
token's frame handed to the server) — where a slow TTFT went) and engine_ms (inside the engine
replica, the first token's handoff to vLLM's engine core, queue wait, prefill and way back to the replica:
engine/vllm_engine.py `first_chunk_ms`). Never prompt text or keys: `ingress.log_request_text` (a debug setting)
adds the last input text, and nothing adds keys. Written through its own logger (no propagation), so it stays one line of JSON
whatever the process's logging setup.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

# time.monotonic() when the HTTP request reached the app (set by the outer ASGI middleware, before routing and the
# body): the request log's phases start there
ARRIVED: contextvars.ContextVar[float | None] = contextvars.ContextVar("serve_app_arrived", default=None)

_logger = logging.getLogger("serve_app.requests")


class _Stdout(logging.StreamHandler):
    """Writes to whatever sys.stdout is at the time (Ray and pytest both replace it)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _ensure_handler() -> logging.Logger:
    if not _logger.handlers:
        handler = _Stdout()
        handler.setFormatter(logging.Formatter("%(message)s"))
        _logger.addHandler(handler)
        _logger.setLevel(logging.INFO)
        _logger.propagate = False
    return _logger


def record(
    *,
    request_id: str,
    tenant: str | None,
    api: str,
    model: str,
    prompt_tokens: int,
    cached_tokens: int | None = None,
    output_tokens: int = 0,
    ttft_s: float | None = None,
    duration_s: float | None = None,
    finish_reason: str | None = None,
    replica: str | None = None,
    route: str | None = None,
    predicted_cached: int | None = None,
    phases_ms: dict[str, float] | None = None,
    engine_ms: dict[str, float] | None = None,
    error: str | None = None,
    text: str | None = None,
) -> dict[str, Any]:
    """The line's fields; `text` only when the caller's debug setting allowed it."""
    out: dict[str, Any] = {
        "ts": round(time.time(), 3),
        "request_id": request_id,
        "tenant": tenant,
        "api": api,
        "model": model,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "output_tokens": output_tokens,
        "ttft_s": None if ttft_s is None else round(ttft_s, 4),
        "duration_s": None if duration_s is None else round(duration_s, 4),
        "finish_reason": finish_reason,
        "replica": replica,
        "route": route,
        "predicted_cached": predicted_cached,
    }
    if phases_ms:
        out["phases_ms"] = phases_ms
    if engine_ms:
        out["engine_ms"] = engine_ms
    if error is not None:
        out["error"] = error[:300]
    if text is not None:
        out["text"] = text
    return out


def emit(fields: dict[str, Any]) -> None:
    _ensure_handler().info(json.dumps(fields, separators=(",", ":"), ensure_ascii=False, default=str))
