"""Structured output requests from the three APIs, read into one `OutputFormat` the engine enforces with a grammar.

Chat Completions: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema,
strict}}. Responses: `text.format` {"type": "text" | "json_object" | "json_schema", name, schema, strict} (Codex
sends it for `codex exec --output-schema`). Anthropic: `output_config.format` {"type": "json_schema", schema}
(and the beta's top-level `output_format`).
"""

from __future__ import annotations

from typing import Any

from serve_app.conversation import OutputFormat
from serve_app.errors import InvalidRequest


def _schema(raw: Any, param: str) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise InvalidRequest(f"{param}: a JSON schema object is required", param=param)
    return raw


def _kind(raw: Any, param: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(raw, dict) or raw.get("type") not in allowed:
        shown = raw.get("type") if isinstance(raw, dict) else type(raw).__name__
        raise InvalidRequest(f"{param}.type: expected one of {', '.join(allowed)}, got {shown!r}", param=f"{param}.type")
    return raw["type"]


def _openai(raw: Any, param: str, nested: str | None) -> OutputFormat | None:
    """Both OpenAI APIs: text | json_object | json_schema; the schema's fields sit under `nested` (Chat) or beside
    `type` (Responses)."""
    if raw is None:
        return None
    kind = _kind(raw, param, ("text", "json_object", "json_schema"))
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat()
    spec = raw.get(nested) if nested else raw
    where = f"{param}.{nested}" if nested else param
    if not isinstance(spec, dict):
        raise InvalidRequest(f"{where}: an object with name and schema is required", param=where)
    # No schema at all: any JSON (OpenAI marks `schema` optional); a schema that is not an object: a 400.
    schema = None if spec.get("schema") is None else _schema(spec["schema"], f"{where}.schema")
    return OutputFormat(schema, spec.get("name"), bool(spec.get("strict", False)))


def from_chat(response_format: Any) -> OutputFormat | None:
    return _openai(response_format, "response_format", "json_schema")


def from_responses(fmt: Any) -> OutputFormat | None:
    return _openai(fmt, "text.format", None)


def from_anthropic(fmt: Any, param: str) -> OutputFormat | None:
    if fmt is None:
        return None
    _kind(fmt, param, ("json_schema",))
    return OutputFormat(_schema(fmt.get("schema"), f"{param}.schema"))
