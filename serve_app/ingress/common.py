"""Helpers shared by the protocol adapters: the one validation-error formatter, agent hints."""

from __future__ import annotations

from typing import Any, Iterable, TypeVar

from pydantic import BaseModel, ValidationError

from serve_app.conversation import AgentHints
from serve_app.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)


def _client_path(loc: tuple, data: Any) -> list[str]:
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


def invalid_request(errors: Iterable[dict[str, Any]], data: Any) -> InvalidRequest:
    """A 400 naming the field, e.g. `messages.0.content.0.text: Field required`, for every API.

    Of several errors (one per union branch) the deepest path wins: that is the branch the client meant, e.g. the
    list form of `input: str | list[...]` rather than "input: Input should be a valid string"."""
    best: tuple[list[str], str] | None = None
    for err in errors:
        path = _client_path(tuple(err.get("loc", ())), data)
        if best is None or len(path) > len(best[0]):
            msg = err.get("msg", "invalid value")
            if err.get("type") == "value_error":
                msg = msg.removeprefix("Value error, ")  # our own validators' words, without pydantic's label
            best = (path, msg)
    if best is None:
        return InvalidRequest("invalid request body")
    path, msg = best
    where = ".".join(path) or "body"
    return InvalidRequest(f"{where}: {msg}", param=where)


def parse_model(cls: type[M], body: Any) -> M:
    """`cls` validated from a request body; a ValidationError becomes the 400 above."""
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise invalid_request(e.errors(include_url=False), body) from None


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


def thinking_switch(chat_template_kwargs: dict[str, Any], *otherwise: bool | None) -> bool | None:
    """The request's thinking switch: the chat template kwargs' `enable_thinking`, else their `thinking` (what
    DeepSeek's and Kimi's templates read, and what vLLM's parsers for them switch on), else the first of
    `otherwise` (the API's own fields, in precedence order) that is set."""
    for key in ("enable_thinking", "thinking"):
        value = chat_template_kwargs.get(key)
        if isinstance(value, bool):
            return value
    return next((v for v in otherwise if v is not None), None)
