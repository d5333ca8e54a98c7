"""The OpenAI error envelope, `{"error": {"message", "type", "param", "code"}}`: Chat Completions, Responses (for
answers that are not a stream), models, tokenize and metrics routes all answer errors in it."""

from __future__ import annotations

import math
from typing import Any

from starlette.responses import JSONResponse

from serve_app.errors import PromptTooLong, ServiceError

# The one table of the OpenAI APIs: serve_app.errors kind → (HTTP status, error `type`). Overload is OpenAI's
# 503 (`code` server_is_overloaded, set by errors.Overloaded), which the `openai` SDK and Codex retry; Anthropic's
# 529 is not a status OpenAI clients know.
ERRORS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "authentication": (401, "authentication_error"),
    "permission": (403, "permission_error"),
    "not_found": (404, "not_found_error"),
    "request_too_large": (413, "invalid_request_error"),
    "rate_limit": (429, "rate_limit_error"),
    "overloaded": (503, "service_unavailable_error"),
    "timeout": (504, "timeout"),
    "api_error": (500, "server_error"),
}


def error_type(kind: str | None) -> str:
    return ERRORS.get(kind or "api_error", ERRORS["api_error"])[1]


def status_of(exc: ServiceError) -> int:
    return exc.status_override or ERRORS.get(exc.kind, ERRORS["api_error"])[0]


def error_body(kind: str, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type(kind), "param": param, "code": code}}


def error_response(exc: ServiceError, *, responses: bool = False) -> JSONResponse:
    """`responses`: the Responses API's answer, which words a prompt too long its own way and blames it on `input`
    (Chat: `messages`)."""
    headers = {}
    if exc.retry_after is not None:  # rounded up: a client that waits what it is told is never early
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after)))
    message, param = exc.message, exc.param
    if isinstance(exc, PromptTooLong):
        # the words OpenAI clients match
        message, param = (exc.responses_message, "input") if responses else (exc.openai_message, "messages")
    return JSONResponse(error_body(exc.kind, message, param, exc.code), status_code=status_of(exc),
                        headers=headers)
