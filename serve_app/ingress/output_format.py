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


def from_chat(response_format: Any) -> OutputFormat | None:
    if response_format is None:
        return None
    kind = _kind(response_format, "response_format", ("text", "json_object", "json_schema"))
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat()
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest("response_format.json_schema: an object with name and schema is required",
                             param="response_format.json_schema")
    return OutputFormat(_schema(spec.get("schema", {}), "response_format.json_schema.schema"), spec.get("name"),
                        bool(spec.get("strict", False)))


def from_responses(fmt: Any) -> OutputFormat | None:
    if fmt is None:
        return None
    kind = _kind(fmt, "text.format", ("text", "json_object", "json_schema"))
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat()
    return OutputFormat(_schema(fmt.get("schema"), "text.format.schema"), fmt.get("name"), bool(fmt.get("strict", False)))


def from_anthropic(fmt: Any, param: str) -> OutputFormat | None:
    if fmt is None:
        return None
    _kind(fmt, param, ("json_schema",))
    return OutputFormat(_schema(fmt.get("schema"), f"{param}.schema"))

