"""The structural-tag format of a call's arguments written as elements named after them (MiniMax-M3,
xml_elements.py): per property `NS<key>` value `NS</key>`, in the schema's order, required ones always; a string's
value raw text (one of its enum's strings where it has one), a number's or boolean's JSON text (what the template
writes for them), an object's properties as elements again, an array's items as `NS<item>` elements."""

from __future__ import annotations

from typing import Any

from serve_app.parsers.schema import STRINGY, types_of
from serve_app.parsers.xml_elements import schema_container

_ANY = {"type": "any_text"}
MAX_DEPTH = 8  # deeper schemas are free text there (the parser still types what is written)


def _members(props: dict, required: Any, ns: str, depth: int) -> dict[str, Any]:
    if not props:
        return {"type": "const_string", "value": ""}
    need = set(required) if isinstance(required, list) else set()
    elements = []
    for key, prop in props.items():
        tag = {"type": "tag", "begin": f"{ns}<{key}>", "content": _value(prop, ns, depth + 1), "end": f"{ns}</{key}>"}
        elements.append(tag if key in need else {"type": "optional", "content": tag})
    return {"type": "sequence", "elements": elements}


def _value(prop: Any, ns: str, depth: int) -> dict[str, Any]:
    if not isinstance(prop, dict) or depth > MAX_DEPTH:
        return _ANY
    types = types_of(prop)
    enum = prop.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return {"type": "or", "elements": [{"type": "const_string", "value": v} for v in enum]}
    if types & STRINGY:
        return _ANY  # a string may be written, so anything may
    box = schema_container(prop)
    if box is not None and not types - {box[0]}:
        kind, sub = box
        if kind == "array":
            item = {"type": "tag", "begin": f"{ns}<item>", "content": _value(sub.get("items"), ns, depth + 1),
                    "end": f"{ns}</item>"}
            return {"type": "star", "content": item}
        props = sub.get("properties")
        return _members(props, sub.get("required"), ns, depth) if isinstance(props, dict) else _ANY
    if types and not types & {"object", "array"}:  # numbers, booleans, null: their JSON text
        return {"type": "json_schema", "json_schema": prop, "style": "json"}
    return _ANY


def element_arguments(schema: Any, ns: str) -> dict[str, Any]:
    """The arguments of one call; a schema without properties lets any text stand."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return _ANY
    return _members(props, schema.get("required"), ns, 0)
