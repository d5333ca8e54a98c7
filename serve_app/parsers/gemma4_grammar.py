"""The arguments of a Gemma 4 call (`call:get_weather{city:<|"|>Paris<|"|>,days:3}`) as an xgrammar EBNF grammar,
from the tool's JSON schema: what sits between the call's braces, read back by gemma4.py as schema-valid JSON.

The same composition as pythonic_grammar.py (declared properties in their order, required ones present, rules
sharing each list's tail), in Gemma 4's notation, written the way its chat template writes it: `key:value` joined
by `,` with no spaces, bare keys, strings between `<|"|>` delimiters, bare numbers and `true`/`false`/`null`.

What the notation cannot carry is not written: a string never contains the delimiter (it would end there); a key
the parser would not read back as itself (empty, padded with whitespace, holding `:` or `,{}[]`, too long) is left
out, and where it is required, or every enum value is unwritable, the call cannot be written at all (`NEVER`).
Checked values: a number's is xgrammar's JSON number grammar (JSON number text is a bare number); a string with
only lengths is `[^"]{min,max}` (without `"` it cannot form the delimiter); a `pattern` is xgrammar's grammar of
the regex over the raw text (like xgrammar's JSON style, lengths beside a pattern are not enforced; a pattern that
admits `<|"|>` itself admits an early end); a `format` is xgrammar's JSON string grammar between the delimiters
(its formats write plain characters; every `"` it could write is escaped, so no delimiter forms).
"""

from __future__ import annotations

import json
import re
from typing import Any

from serve_app.parsers.gemma4 import TOKEN_CAP
from serve_app.parsers.pythonic_grammar import ArgumentGrammar, quoted, renamed

DELIM = '<|"|>'
_Q = quoted(DELIM)
# Any value the parser reads. A string's text is any text without the delimiter: runs of `<` each followed by part
# of `|"|`, each run broken by a character that does not go on with the delimiter (the parts are border-free).
_BASE = rf'''g_value ::= g_string | g_number | "true" | "false" | "null" | g_list | g_obj
g_string ::= {_Q} g_text {_Q}
g_text ::= ([^<] | g_lt* ("<" [^<|] | "<|" [^<"] | "<|\"" [^<|] | "<|\"|" [^<>]))* g_lt*
g_lt ::= "<" | "<|" | "<|\"" | "<|\"|"
g_int ::= "-"? ("0" | [1-9] [0-9]*)
g_number ::= g_int | "-"? ("0" | [1-9] [0-9]{{0,15}}) ("." [0-9]+)? ([eE] [+\-]? [0-9]{{1,2}})?
g_list ::= "[" "]" | "[" g_value ("," g_value)* "]"
g_key ::= [A-Za-z_$] [A-Za-z0-9_$.\-]*
g_member ::= g_key ":" g_value
g_obj ::= "{{" "}}" | "{{" g_member ("," g_member)* "}}"'''
# (a number with a fraction or exponent is a float: its digits are bounded so it stays finite, not a string)
_PLAIN = {"string": "g_string", "integer": "g_int", "number": "g_number", "boolean": '("true" | "false")',
          "null": '"null"'}
_KEY_BREAKS = set(":,{}[]")
_QUOTED_LEAF = re.compile(r'\(\("\\"" (.*) "\\""\)\)')


def _writable_key(key: str) -> bool:
    """Whether gemma4.py reads `key:` back as `key` (it strips the key and stops it at `:` or a bracket)."""
    return bool(key) and key == key.strip() and not (set(key) & _KEY_BREAKS) and DELIM not in key \
        and len(key) <= TOKEN_CAP


def gemma_literal(value: Any) -> str | None:
    """`value` in Gemma 4's notation, or None where the notation cannot write it."""
    if value is True or value is False or value is None:
        return json.dumps(value)
    if isinstance(value, str):
        return None if DELIM in value else DELIM + value + DELIM
    if isinstance(value, list):
        items = [gemma_literal(v) for v in value]
        return None if None in items else "[" + ",".join(items) + "]"  # type: ignore[arg-type]
    if isinstance(value, dict):
        items = [gemma_literal(v) if _writable_key(str(k)) else None for k, v in value.items()]
        if None in items:
            return None
        return "{" + ",".join(f"{k}:{v}" for k, v in zip(value, items)) + "}"
    return json.dumps(value)  # a number (finite: JSON schemas hold no others)


class _GemmaGrammar(ArgumentGrammar):
    BASE = _BASE
    ANY = "g_value"
    ANY_DICT = "g_obj"
    PLAIN = _PLAIN
    SEP = ","
    FREE_ARGS = ('g_member ("," g_member)* | ""', None)  # g_member is a base rule

    @staticmethod
    def literal(value: Any) -> str | None:
        return gemma_literal(value)

    @staticmethod
    def dict_key(key: str) -> str | None:
        return quoted(f"{key}:") if _writable_key(key) else None

    arg_key = dict_key

    def checked(self, schema: dict[str, Any]) -> str:
        if schema["type"] != "string":
            return self.leaf(schema)  # a JSON number is a bare number
        if "pattern" in schema:
            return self._regex(schema["pattern"])
        if "format" in schema:
            leaf = self.leaf(schema)  # `"\"" body "\""`: the quotes become the delimiter
            self.rules.append(f'{leaf}_g ::= {_Q} {self._unquoted(leaf)} {_Q}')
            return f"{leaf}_g"
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        return f'{_Q} [^"]{{{lo},{"" if hi is None else int(hi)}}} {_Q}'

    def _unquoted(self, leaf: str) -> str:
        """The body of a JSON string leaf's root rule (`(("\"" X "\""))` -> `X`)."""
        body = next(r for r in self.rules if r.startswith(f"{leaf} ::= ")).split(" ::= ", 1)[1]
        m = _QUOTED_LEAF.fullmatch(body.strip())
        assert m is not None, body  # xgrammar writes a string schema's root as its quotes around the text
        return m.group(1)

    def _regex(self, pattern: str) -> str:
        """xgrammar's grammar of the regex (the raw text it matches), its rules renamed, between the delimiters."""
        key = "re:" + pattern
        if key not in self.leaves:
            import xgrammar as xgr

            prefix = f"j{len(self.leaves)}_"
            lines = [ln for ln in str(xgr.Grammar.from_regex(pattern)).splitlines() if " ::= " in ln]
            names = {ln.split(" ::= ", 1)[0] for ln in lines}
            for ln in lines:
                name, body = ln.split(" ::= ", 1)
                self.rules.append(f"{prefix}{name} ::= {renamed(body, names, prefix)}")
            self.rules.append(f"{prefix}str ::= {_Q} {prefix}root {_Q}")
            self.leaves[key] = f"{prefix}str"
        return self.leaves[key]


def gemma_arguments(schema: Any) -> dict[str, Any] | None:
    """The structural-tag format of a Gemma 4 call's arguments, between its braces (None: it takes none)."""
    return _GemmaGrammar().arguments(schema)
