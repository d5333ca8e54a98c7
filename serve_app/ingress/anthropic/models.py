"""The Anthropic shape of model objects and the model list (harness-contracts A1), for GET /v1/models and
GET /v1/models/{id} when the request carries `anthropic-version`. Plain functions; the models route calls them."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from serve_app.errors import InvalidRequest
from serve_app.settings import ModelConfig


def model_object(model_id: str, m: ModelConfig) -> dict[str, Any]:
    return {
        "type": "model",
        "id": model_id,
        "display_name": m.display_name or model_id,
        "created_at": m.created_at,
        "max_input_tokens": m.max_model_len,
        "max_tokens": m.max_output_tokens,
        # Required by the current SDK's ModelInfo: a served model is active and has no retirement scheduled.
        "lifecycle": "active",
        "deprecated_at": None,
        "retires_at": None,
    }


def _limit(params: Mapping[str, str]) -> int:
    raw = params.get("limit")
    if raw is None or raw == "":
        return 20
    try:
        n = int(raw)
    except ValueError:
        raise InvalidRequest("limit: Input should be a valid integer", param="limit") from None
    if not 1 <= n <= 1000:
        raise InvalidRequest("limit: Input should be between 1 and 1000", param="limit")
    return n


def model_list(served: Iterable[tuple[str, ModelConfig]], params: Mapping[str, str]) -> dict[str, Any]:
    """`served` is every (id, config) pair in listing order (aliases included, so `claude-…` aliases reach Claude
    Code's /model picker). Cursor paging like the API: `after_id` pages forward, `before_id` backward."""
    items = [model_object(mid, m) for mid, m in served]
    limit = _limit(params)
    ids = [o["id"] for o in items]
    after, before = params.get("after_id"), params.get("before_id")
    if before:
        if before not in ids:
            raise InvalidRequest(f"before_id: unknown model id {before!r}", param="before_id")
        end = ids.index(before)
        start = max(0, end - limit)
        page, has_more = items[start:end], start > 0
    else:
        start = 0
        if after:
            if after not in ids:
                raise InvalidRequest(f"after_id: unknown model id {after!r}", param="after_id")
            start = ids.index(after) + 1
        page = items[start : start + limit]
        has_more = start + limit < len(items)
    return {
        "data": page,
        "has_more": has_more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }
