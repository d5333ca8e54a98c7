"""Anthropic error envelope and statuses (harness-contracts A9).

`{"type":"error","error":{"type","message"},"request_id"}` plus a `request-id` header; 429/529 carry
`retry-after` (and `retry-after-ms`) so the SDK's retry waits as long as the server asks.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from serve_app.errors import ServiceError

ERROR_TYPES: dict[str, str] = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "request_too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "overloaded": "overloaded_error",
    "timeout": "timeout_error",
    "api_error": "api_error",
}


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


def error_type(kind: str | None) -> str:
    return ERROR_TYPES.get(kind or "api_error", "api_error")


def error_body(kind: str | None, message: str, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type(kind), "message": message}}
    if request_id:
        body["request_id"] = request_id
    return body


def error_headers(exc: ServiceError, request_id: str) -> dict[str, str]:
    headers = {"request-id": request_id}
    if exc.retry_after is not None:
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after)))
        headers["retry-after-ms"] = str(max(1, int(exc.retry_after * 1000)))
    if exc.status == 413:
        # Anthropic's SDK would retry nothing here anyway; say so explicitly for other clients.
        headers["x-should-retry"] = "false"
    return headers


def error_response(exc: ServiceError, request_id: str) -> JSONResponse:
    return JSONResponse(
        error_body(exc.kind, exc.message, request_id),
        status_code=exc.status,
        headers=error_headers(exc, request_id),
    )


def _clean_loc(loc: tuple, data: Any) -> list[str]:
    """The path of a validation error in the client's own terms: union-branch labels pydantic inserts
    (`str`, `list[tagged-union[...]]`, discriminator tags) are dropped by walking the input alongside."""
    out: list[str] = []
    cur = data
    for i, item in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(item, int) and isinstance(cur, list) and 0 <= item < len(cur):
            out.append(str(item))
            cur = cur[item]
        elif isinstance(item, str) and isinstance(cur, dict) and item in cur:
            out.append(item)
            cur = cur[item]
        elif last and isinstance(cur, dict) and isinstance(item, str) and "[" not in item:
            out.append(item)  # a missing field
    return out


def validation_error(exc: ValidationError, data: Any) -> ServiceError:
    """A 400 naming the field, e.g. `messages.0.content.0.text: Field required`."""
    best: tuple[list[str], str] | None = None
    for err in exc.errors(include_url=False):
        path = _clean_loc(tuple(err.get("loc", ())), data)
        if best is None or len(path) > len(best[0]):
            best = (path, err.get("msg", "invalid value"))
    if best is None:
        return ServiceError("invalid_request", "invalid request body")
    path, msg = best
    where = ".".join(path) or "body"
    return ServiceError("invalid_request", f"{where}: {msg}", param=where)
