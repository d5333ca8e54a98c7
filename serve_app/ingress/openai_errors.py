"""The OpenAI error envelope, `{"error": {"message", "type", "param", "code"}}`: Chat Completions, Responses (for
answers that are not a stream), models, tokenize and metrics routes all answer errors in it."""

from __future__ import annotations

import math
from typing import Any

from starlette.responses import JSONResponse

from serve_app.errors import PromptTooLong, ServiceError

ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "request_too_large": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "overloaded": "server_overloaded",
    "timeout": "timeout",
    "api_error": "server_error",
}


def error_body(kind: str, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(kind, "server_error"), "param": param, "code": code}}


def error_response(exc: ServiceError, *, prompt_param: str = "messages") -> JSONResponse:
    """`prompt_param` is what this API calls the prompt: a prompt too long is blamed on it (Chat `messages`,
    Responses `input`)."""
    headers = {}
    if exc.retry_after is not None:  # rounded up: a client that waits what it is told is never early
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after)))
    message, param = exc.message, exc.param
    if isinstance(exc, PromptTooLong):
        message, param = exc.openai_message, prompt_param  # the words OpenAI clients match
    return JSONResponse(error_body(exc.kind, message, param, exc.code), status_code=exc.status,
                        headers=headers)
