"""The Anthropic error envelope and statuses, the only copy (harness-contracts A9).

`{"type":"error","error":{"type","message"},"request_id"}` plus a `request-id` header; 429/529 carry
`retry-after` (and `retry-after-ms`) so the SDK's retry waits as long as the server asks.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from starlette.responses import JSONResponse

from serve_app.errors import ServiceError

# The one table of the Anthropic API: serve_app.errors kind → (HTTP status, error `type`), as its error docs list
# them; overload is its 529 `overloaded_error` (the OpenAI APIs answer 503 instead: ingress/openai_errors.py).
ERRORS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "authentication": (401, "authentication_error"),
    "permission": (403, "permission_error"),
    "not_found": (404, "not_found_error"),
    "request_too_large": (413, "request_too_large"),
    "rate_limit": (429, "rate_limit_error"),
    "overloaded": (529, "overloaded_error"),
    "timeout": (504, "timeout_error"),
    "api_error": (500, "api_error"),
}
ERROR_TYPES: dict[str, str] = {kind: type_ for kind, (_, type_) in ERRORS.items()}


def new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


def error_type(kind: str | None) -> str:
    return ERROR_TYPES.get(kind or "api_error", "api_error")


def status_of(exc: ServiceError) -> int:
    return exc.status_override or ERRORS.get(exc.kind, ERRORS["api_error"])[0]


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
    if status_of(exc) == 413:
        # Anthropic's SDK would retry nothing here anyway; say so explicitly for other clients.
        headers["x-should-retry"] = "false"
    return headers


def error_response(exc: ServiceError, request_id: str | None = None) -> JSONResponse:
    """The Anthropic answer to `exc`; `request_id` when the route already named the request."""
    request_id = request_id or new_request_id()
    return JSONResponse(
        error_body(exc.kind, exc.message, request_id),
        status_code=status_of(exc),
        headers=error_headers(exc, request_id),
    )
