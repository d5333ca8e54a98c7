"""Helpers shared by the protocol adapters: validation errors that name the field, agent hints."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from serve_app.conversation import AgentHints
from serve_app.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)


def describe_validation_error(err: ValidationError) -> tuple[str, str]:
    """(param path, message) for the first error, e.g. ("messages.0.role", "messages.0.role: Input should be ...")."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        msg = "field required"
    elif first.get("type") == "value_error":
        msg = msg.removeprefix("Value error, ")  # our own validators' words, without pydantic's label
    return loc, f"{loc}: {msg}" if loc else msg


def parse_model(cls: type[M], body: Any) -> M:
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        param, message = describe_validation_error(e)
        raise InvalidRequest(message, param=param) from None


def agent_hints(raw: Any) -> AgentHints:
    if raw is None:
        return AgentHints()
    get = raw.get if isinstance(raw, dict) else lambda k, d=None: getattr(raw, k, d)
    return AgentHints(
        priority=get("priority"),
        osl=get("osl"),
        speculative_prefill=bool(get("speculative_prefill", False)),
        latency_sensitivity=get("latency_sensitivity"),
    )
