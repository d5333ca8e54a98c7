"""The keyword arguments of a pythonic call (`get_weather(city="Paris", days=3)`) as an xgrammar EBNF grammar, from
the tool's JSON schema: the declared properties in their order, each as `name=value`, required ones present, no
undeclared ones; values are Python literals that the parser's `ast.literal_eval` reads back as schema-valid values.

xgrammar has no Python style, so the grammar is written here, as rules (rules share the tail of an argument list:
written out as one tree it grows with the square of the optional properties). Strings are double-quoted,
booleans and null are `True`/`False`/`None`, lists and dicts follow `items`, `minItems`/`maxItems`, `properties`
and `required`, enums and consts are their literals. A string or number with a constraint xgrammar checks
(`pattern`, `format`, lengths, ranges, `multipleOf`) takes xgrammar's own JSON-schema grammar for that value (its
JSON text is its Python literal), with its rules renamed. A subschema this grammar does not follow (`$ref`,
`allOf`, `prefixItems`, `not`, conditionals) and an untyped one take any Python literal: syntax-checked only.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Any Python literal the parser's literal_eval reads (double-quoted strings)
_BASE = r'''py_value ::= py_string | py_number | "True" | "False" | "None" | py_list | py_dict
py_string ::= "\"" ([^"\\\r\n] | "\\" [^\r\n])* "\""
py_int ::= "-"? ("0" | [1-9] [0-9]*)
py_number ::= py_int ("." [0-9]+)? ([eE] [+\-]? [0-9]+)?
py_list ::= "[" "]" | "[" py_value (", " py_value)* "]"
py_dict ::= "{" "}" | "{" py_string ": " py_value (", " py_string ": " py_value)* "}"'''
_UNFOLLOWED = ("$ref", "allOf", "prefixItems", "not", "if", "then", "else", "patternProperties", "dependentSchemas")
_CHECKED = ("pattern", "format", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
            "exclusiveMaximum", "multipleOf")  # what xgrammar's own leaf grammar enforces
_PLAIN = {"string": "py_string", "integer": "py_int", "number": "py_number", "boolean": '("True" | "False")',
          "null": '"None"'}
NEVER = "[^\\0-\\U0010ffff]"  # matches nothing: a value or a required key the notation cannot write
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def literal(value: Any) -> str:
    """`value` as the Python literal the grammar writes (json.dumps's strings are valid Python strings)."""
    if value is True or value is False or value is None:
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{quoted(str(k))}: {literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


def quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def renamed(body: str, names: set[str], prefix: str) -> str:
    """An xgrammar rule body with its rule references prefixed (string literals and character classes kept)."""
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c in '"[':
            close, j = ('"' if c == '"' else "]"), i + 1
            while body[j] != close:
                j += 2 if body[j] == "\\" else 1
            out.append(body[i:j + 1])
            i = j + 1
        elif (m := _IDENT.match(body, i)) is not None:
            out.append(prefix + m.group() if m.group() in names else m.group())
            i = m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


class ArgumentGrammar:
    """The grammar of one call's arguments. The notation's hooks (Python literals here; gemma4_grammar.py overrides
    them for Gemma 4's notation): its base rules, its any-value and any-dict rules, plain types, the separator of
    items, how a literal, a dict key and an argument name are written, and free arguments (root, rule)."""

    BASE = _BASE
    ANY = "py_value"
    ANY_DICT = "py_dict"
    PLAIN = _PLAIN
    SEP = ", "
    FREE_ARGS: tuple[str, str | None] = ('kw (", " kw)* | ""', 'kw ::= [A-Za-z_] [A-Za-z_0-9]* "=" py_value')

    def __init__(self) -> None:
        self.rules: list[str] = [self.BASE]
        self.count = 0
        self.leaves: dict[str, str] = {}  # a checked leaf schema (JSON) -> its root rule

    def rule(self, body: str) -> str:
        name = f"r{self.count}"
        self.count += 1
        self.rules.append(f"{name} ::= {body}")
        return name

    @staticmethod
    def literal(value: Any) -> str | None:
        return literal(value)

    @staticmethod
    def dict_key(key: str) -> str | None:
        return quoted(json.dumps(key, ensure_ascii=False) + ": ")

    @staticmethod
    def arg_key(name: str) -> str | None:
        return quoted(f"{name}=")

    def leaf(self, schema: dict[str, Any]) -> str:
        """xgrammar's grammar for a checked string or number, its rules renamed into this grammar."""
        key = json.dumps(schema, sort_keys=True)
        if key not in self.leaves:
            import xgrammar as xgr  # the engine's own grammar library; loaded only for a format written here

            prefix = f"j{len(self.leaves)}_"
            lines = [ln for ln in str(xgr.Grammar.from_json_schema(key, any_whitespace=False)).splitlines()
                     if " ::= " in ln]
            names = {ln.split(" ::= ", 1)[0] for ln in lines}
            for ln in lines:
                name, body = ln.split(" ::= ", 1)
                self.rules.append(f"{prefix}{name} ::= {renamed(body, names, prefix)}")
            self.leaves[key] = f"{prefix}root"
        return self.leaves[key]

    def value(self, schema: Any) -> str:
        """An EBNF expression for one value valid against `schema`."""
        if not isinstance(schema, dict) or any(k in schema for k in _UNFOLLOWED):
            return self.ANY
        if "const" in schema:
            return self.literal_rule([schema["const"]])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.literal_rule(schema["enum"])
        subs = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(subs, list) and subs:
            return "(" + " | ".join(self.value(s) for s in subs) + ")"
        t = schema.get("type")
        types = [t] if isinstance(t, str) else t if isinstance(t, list) else []
        if not types:
            return self.ANY
        return "(" + " | ".join(self._typed(schema, t) for t in types) + ")"

    def literal_rule(self, values: list[Any]) -> str:
        """One of `values`, each written as the notation's literal (one it cannot write is left out)."""
        texts = [t for t in map(self.literal, values) if t is not None]
        return "(" + " | ".join(map(quoted, texts)) + ")" if texts else NEVER

    def _typed(self, schema: dict[str, Any], t: str) -> str:
        if t == "array":
            return self._array(schema)
        if t == "object":
            return self._dict(schema)
        if t in ("string", "integer", "number") and any(k in schema for k in _CHECKED):
            return self.checked({"type": t, **{k: schema[k] for k in _CHECKED if k in schema}})
        return self.PLAIN.get(t, self.ANY)

    def checked(self, schema: dict[str, Any]) -> str:
        """A string or number with a constraint xgrammar checks: its own grammar (JSON text is a Python literal)."""
        return self.leaf(schema)

    def _array(self, schema: dict[str, Any]) -> str:
        item = self.rule(self.value(schema.get("items", True)))
        lo, hi = int(schema.get("minItems", 0)), schema.get("maxItems")
        if hi is not None and int(hi) == 0:
            return '"[" "]"'
        more = f'({quoted(self.SEP)} {item})' + ("*" if hi is None and lo <= 1 else
                                                  f"{{{max(lo - 1, 0)},}}" if hi is None else
                                                  f"{{{max(lo - 1, 0)},{int(hi) - 1}}}")
        full = f'"[" {item} {more} "]"'
        return self.rule(f'"[" "]" | {full}' if lo == 0 else full)

    def _dict(self, schema: dict[str, Any]) -> str:
        props = schema.get("properties")
        if not isinstance(props, dict) or not props:
            return self.ANY_DICT
        members = self.members([(self.dict_key(k), k, s) for k, s in props.items()], set(schema.get("required") or []))
        return self.rule(f'"{{" {members} "}}"')

    def members(self, items: list[tuple[str | None, str, Any]], required: set[str]) -> str:
        """`key value` items in their order, separated by SEP, required ones present, optional ones optional:
        `rest_i`, the items from i on after something was written; `first_i`, the same with nothing written yet.
        A key the notation cannot write (None) is left out, or, required, leaves nothing to write."""
        if any(key is None and name in required for key, name, _ in items):
            return NEVER
        items = [it for it in items if it[0] is not None]
        kv = [self.rule(f"{key} {self.value(s)}") for key, _, s in items]
        sep = quoted(self.SEP)
        rest, first = ['""'], ['""']  # built from the end: index 0 is the tail
        for (_, name, _), k in zip(reversed(items), reversed(kv)):
            after = rest[-1]
            if name in required:
                rest.append(self.rule(f'{sep} {k} {after}'))
                first.append(self.rule(f"{k} {after}"))
            else:
                rest.append(self.rule(f'({sep} {k})? {after}'))
                first.append(self.rule(f"{k} {after} | {first[-1]}"))
        return first[-1]

    def arguments(self, schema: Any) -> dict[str, Any] | None:
        """The structural-tag format of a call's arguments (None: the call takes none); `schema` is the tool's
        parameters."""
        props = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(schema, dict) or any(k in schema for k in _UNFOLLOWED) or not isinstance(props, dict):
            root, free = self.FREE_ARGS  # any arguments, each value syntax-checked only
            if free:
                self.rules.append(free)
        elif not props:
            return None
        else:
            root = self.members([(self.arg_key(k), k, s) for k, s in props.items()], set(schema.get("required") or []))
        return {"type": "grammar", "grammar": "\n".join([f"root ::= {root}", *self.rules]) + "\n"}


def keyword_arguments(schema: Any) -> dict[str, Any] | None:
    """The structural-tag format of a pythonic call's keyword arguments (None: the call takes none)."""
    return ArgumentGrammar().arguments(schema)
