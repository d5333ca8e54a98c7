"""Typing of XML-style parameter values from the tool's JSON schema.

XML formats carry every value as text; the schema says which ones are numbers, booleans, objects or arrays.
Values whose schema allows a string are streamed as JSON strings as they arrive; values that must be typed, and
values the schema does not describe (an unknown tool or parameter: decoded as JSON when they parse, vLLM's rule;
minimax_m2 streams them as strings instead, see XmlFormat.undescribed_string),
are buffered until they close and converted here.
"""

from __future__ import annotations

import ast
import json
from typing import Any

STRINGY = frozenset({"string", "str", "text", "varchar", "char", "enum"})


def types_of(prop: Any) -> frozenset[str]:
    """The JSON types a schema property allows (lower-cased, through anyOf/oneOf; a string enum is a string)."""
    if not isinstance(prop, dict):
        return frozenset()
    t = prop.get("type")
    out: set[str] = set()
    if isinstance(t, str):
        out.add(t.lower())
    elif isinstance(t, list):
        out.update(str(x).lower() for x in t)
    for key in ("anyOf", "oneOf"):
        subs = prop.get(key)
        for sub in subs if isinstance(subs, list) else ():
            out |= types_of(sub)
    vals = prop.get("enum")
    if not out and isinstance(vals, list) and all(isinstance(v, str) for v in vals):
        out.add("string")
    if not out and ("properties" in prop):
        out.add("object")
    return frozenset(out)


class ToolSchemas:
    """name -> {param -> allowed JSON types}, built once per request from OpenAI-style function schemas
    (`{"type": "function", "function": {...}}` or the bare function), Anthropic tools (`input_schema`) or the
    IR's `ToolSpec`s."""

    __slots__ = ("_params", "_props")

    def __init__(self, tool_schemas: list[dict] | None):
        self._params: dict[str, dict[str, frozenset[str]]] = {}
        self._props: dict[str, dict] = {}  # name -> the parameters' own schemas (xml_elements types nested values)
        for spec in tool_schemas or ():
            if not isinstance(spec, dict):  # the IR's ToolSpec (or anything with .name / .parameters)
                spec = {"name": getattr(spec, "name", None), "parameters": getattr(spec, "parameters", None)}
            fn = spec.get("function", spec)
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                continue
            params = fn.get("parameters") or fn.get("input_schema") or {}
            props = params.get("properties") if isinstance(params, dict) else None
            # A schema is the client's and only a hint here: one of the wrong shape types nothing, never fails
            self._params[fn["name"]] = ({k: types_of(v) for k, v in props.items()} if isinstance(props, dict)
                                        else {})
            self._props[fn["name"]] = props if isinstance(props, dict) else {}

    def streams_as_string(self, tool: str, param: str) -> bool:
        """True when the value may be streamed as a JSON string: the schema allows a string."""
        return bool(self.types(tool, param) & STRINGY)

    def nullable_string(self, tool: str, param: str) -> bool:
        """A string that may also be null (`anyOf [string, null]`): the text `null` (or Python's `None`) means null."""
        types = self.types(tool, param)
        return bool(types & STRINGY) and "null" in types

    def properties(self, tool: str) -> dict:
        """The tool's parameter schemas as the client wrote them ({} for an unknown tool)."""
        return self._props.get(tool, {})

    def declares(self, tool: str, param: str) -> bool:
        return param in self._params.get(tool, {})

    def types(self, tool: str, param: str) -> frozenset[str]:
        return self._params.get(tool, {}).get(param, frozenset())


def coerce(raw: str, types: frozenset[str]) -> str:
    """The JSON text for a buffered non-string value. Falls back to a JSON string when the text does not fit."""
    s = raw.strip()
    # `None` is Python's null: templates that render values with Python's str() (Qwen3.5's) teach models to write it
    if s == "null" or ((s == "" or s == "None") and "null" in types):
        return "null"
    if types & {"integer", "int", "number", "float", "double"}:
        try:
            v = int(s) if ("integer" in types or "int" in types) and "." not in s and "e" not in s.lower() else float(s)
            if isinstance(v, float) and v.is_integer() and not ({"number", "float", "double"} & types):
                v = int(v)
            if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
                raise ValueError
            return json.dumps(v)
        except ValueError:
            pass
    if types & {"boolean", "bool"}:
        low = s.lower()
        if low in ("true", "false"):
            return low
    if types & {"object", "array", "dict", "list"} or not types:
        try:
            v = json.loads(s)
            if isinstance(v, str) and types and not types & STRINGY and (inner := _container(v.strip())) is not None:
                return inner  # an object written as a JSON string of itself (a template that json.dumps'd str(dict))
            return json.dumps(v, ensure_ascii=False)
        except ValueError:
            pass
        if (v := _container(s)) is not None:
            return v
    return json.dumps(raw, ensure_ascii=False)


def _container(s: str) -> str | None:
    """The JSON text of an object or array written as JSON or as a Python literal ({'k': 'v'}: what models trained
    on Python often write), else None."""
    if s[:1] not in ("{", "["):
        return None
    try:
        v = json.loads(s)
    except ValueError:
        try:
            v = ast.literal_eval(s)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else None


def coerce_marked_json(raw: str, types: frozenset[str]) -> str:
    """DSML `string="false"` values. A parameter the schema describes gets the schema's type (a string parameter stays
    a string even when the text is `null` or `42`, vLLM's rule since May 2026); one it does not describe is decoded
    as the model's marker says (decode_or_string), where vLLM keeps it a string."""
    if not types:
        return decode_or_string(raw)
    if types & STRINGY and not types - STRINGY - {"null"}:
        s = raw.strip()
        if s == "null" and "null" in types:
            return "null"
        try:
            v = json.loads(s)
            if isinstance(v, str):  # a JSON string literal: its text
                return json.dumps(v, ensure_ascii=False)
        except ValueError:
            pass
        return json.dumps(raw, ensure_ascii=False)
    return coerce(raw, types)


def decode_or_string(raw: str) -> str:
    """DSML `string="false"` values: JSON-decoded when they parse, else kept as a string (Dynamo's rule)."""
    try:
        return json.dumps(json.loads(raw), ensure_ascii=False)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)
