"""The arguments of a Kimi K3 call as a structural-tag format, from the tool's JSON schema: what sits between
`<|open|>call tool="NAME" index="N"<|sep|>` and `<|close|>call<|sep|>`, read back by the kimi_k3 parser.

Written the way Kimi K3's template writes a call: one `<|open|>argument key="K" type="T"<|sep|>V<|close|>argument<|sep|>`
element per argument, in the schema's declared order, the required ones present. A string parameter's value is its
raw text (anything up to the close marker); any other type's is JSON checked against the parameter's schema
(xgrammar's JSON-schema format), tagged with the type the template writes for such a value. A parameter whose
schema allows several types (or names none) is written as JSON. A tool without declared properties gets its
arguments as free text up to the call's end (parsed as argument elements).
"""

from __future__ import annotations

from typing import Any

# The template's `xtml_type` of a value of each JSON-schema type
_TYPE = {"integer": "number", "number": "number", "boolean": "boolean", "object": "object", "array": "array",
         "null": "null"}
ARG_CLOSE = "<|close|>argument<|sep|>"


def xtml_attr(value: str) -> str:
    """An attribute value as the template writes it (`&` then `"` escaped)."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _argument(key: str, prop: Any) -> dict[str, Any]:
    types = prop.get("type") if isinstance(prop, dict) else None
    types = [types] if isinstance(types, str) else [t for t in (types or []) if isinstance(t, str)]
    head = f'<|open|>argument key="{xtml_attr(key)}" type="'
    if types == ["string"]:
        return {"type": "tag", "begin": head + 'string"<|sep|>', "content": {"type": "any_text"}, "end": ARG_CLOSE}
    typed = [t for t in types if t != "string"]
    tag = _TYPE.get(typed[0], "object") if len(typed) == 1 and len(types) == 1 else "object"
    schema = prop if isinstance(prop, dict) else True
    return {"type": "tag", "begin": head + tag + '"<|sep|>',
            "content": {"type": "json_schema", "json_schema": schema, "style": "json"}, "end": ARG_CLOSE}


def xtml_arguments(schema: Any) -> dict[str, Any]:
    """The structural-tag format of a Kimi K3 call's arguments."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return {"type": "any_text"}
    if not props:
        return {"type": "const_string", "value": ""}
    required = set(schema.get("required") or ()) if isinstance(schema.get("required"), list) else set()
    return {"type": "sequence", "elements": [
        _argument(key, prop) if key in required else {"type": "optional", "content": _argument(key, prop)}
        for key, prop in props.items()]}
