"""Errors the service raises, independent of any wire protocol.

Each protocol adapter maps a `ServiceError` onto its own envelope and status (OpenAI's
`{"error": {...}}`, Anthropic's `{"type": "error", "error": {...}}`, Responses' `response.failed`).
"""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal[
    "invalid_request",
    "authentication",
    "permission",
    "not_found",
    "request_too_large",
    "rate_limit",
    "overloaded",
    "timeout",
    "api_error",
]

# Each kind's status in HTTP's own terms (RFC 9110): `ServiceError.status` unless the raiser named one. What reaches
# the wire is each API's own table (ingress/openai_errors.py, ingress/anthropic/errors.py): Anthropic answers
# overload with its 529.
STATUS: dict[str, int] = {
    "invalid_request": 400,
    "authentication": 401,
    "permission": 403,
    "not_found": 404,
    "request_too_large": 413,
    "rate_limit": 429,
    "overloaded": 503,
    "timeout": 504,
    "api_error": 500,
}


class ServiceError(Exception):
    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        status: int | None = None,
    ):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after
        self.status_override = status  # a status this error has whatever the API (415, 502, a store's 503)
        self.status = status or STATUS[kind]


class InvalidRequest(ServiceError):
    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__("invalid_request", message, param=param, code=code)


class ModelNotFound(ServiceError):
    def __init__(self, model: str):
        super().__init__("not_found", f"model: {model}", param="model", code="model_not_found")
        self.model = model


# What the Responses API says when the input does not fit, word for word (Codex shows it; it acts on the code).
RESPONSES_CONTEXT_EXCEEDED = ("Your input exceeds the context window of this model. Please adjust your input and "
                              "try again.")


class PromptTooLong(ServiceError):
    """A prompt that alone fills the context. `message` is Anthropic's wording (Claude Code compacts on it);
    `openai_message` Chat Completions', `responses_message` the Responses API's (OpenAI words the two APIs'
    errors differently), which the OpenAI envelope and `response.failed` use with the code
    `context_length_exceeded`."""

    def __init__(self, prompt_tokens: int, max_tokens: int):
        super().__init__(
            "invalid_request",
            f"prompt is too long: {prompt_tokens} tokens > {max_tokens} maximum",
            param="messages",
            code="context_length_exceeded",
        )
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_tokens
        self.openai_message = (f"This model's maximum context length is {max_tokens} tokens. However, your "
                               f"messages resulted in {prompt_tokens} tokens. Please reduce the length of the "
                               f"messages.")
        self.responses_message = RESPONSES_CONTEXT_EXCEEDED


class Overloaded(ServiceError):
    def __init__(self, message: str = "the service is overloaded, retry shortly", retry_after: float = 1.0):
        super().__init__("overloaded", message, code="server_is_overloaded", retry_after=retry_after)


class EngineError(ServiceError):
    def __init__(self, message: str):
        super().__init__("api_error", message, code="engine_error")


# Errors that say the replica's actor is gone or unreachable (its node died, it crashed), not that the request
# was bad: a request refused with one of these before it started may go to another replica.
REPLICA_GONE = frozenset({"ActorDiedError", "ActorUnavailableError", "RayActorError"})
# Serve's gRPC transport raises these status codes itself when the connection to a replica breaks (a node lost
# mid-call resets it: "Stream removed" is UNKNOWN); a replica's own exceptions come back inside the response.
_TRANSPORT_GONE = frozenset({"UNAVAILABLE", "UNKNOWN", "INTERNAL", "CANCELLED"})


def replica_gone(e: BaseException) -> bool:
    """Whether `e` says the replica (or the connection to it) is gone rather than that the request failed."""
    name = type(e).__name__
    if name in REPLICA_GONE:
        return True
    if name == "AioRpcError":
        code = getattr(e.code(), "name", None)
        return code in _TRANSPORT_GONE
    return False
