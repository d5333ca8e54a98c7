"""Incremental JSON validation: feed text in pieces, learn where the top-level value ends or that it is malformed.

The JSON-in-tags engines stream the model's argument text as it arrives; this scanner is what lets them do that
and still know (a) when the arguments object closes and (b) that everything streamed so far is a valid JSON
prefix. Strings — the bulk of any large argument — are skipped with one regex search per delta, so the per-char
Python work is limited to structure characters.
"""

from __future__ import annotations

import json
import json.encoder
import re

_WS = re.compile(r"[ \t\n\r]*")
_STR_SPECIAL = re.compile(r'["\\\x00-\x1f]')
_LIT_CHARS = re.compile(r"[0-9A-Za-z+\-.]*")
_LITERAL = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_HEX = frozenset("0123456789abcdefABCDEF")

VAL, OBJ_FIRST, OBJ_KEY, COLON, AFTER, STR, ESC, UHEX, LIT, ARR_FIRST, DONE, ERR = range(12)

NEED_MORE = -1
ERROR = -2


class JsonScanner:
    """Validates one JSON value fed in pieces. `feed(text, i)` returns the index just past the end of the value
    when it completes inside `text`, `NEED_MORE` when all of `text[i:]` was consumed, or `ERROR`."""

    __slots__ = ("state", "stack", "is_key", "hex_left", "lit")

    def __init__(self) -> None:
        self.state = VAL
        self.stack: list[str] = []
        self.is_key = False
        self.hex_left = 0
        self.lit: list[str] = []

    @property
    def done(self) -> bool:
        return self.state == DONE

    def feed(self, text: str, i: int = 0) -> int:
        n = len(text)
        stack = self.stack
        state = self.state
        while i < n:
            if state == STR:
                m = _STR_SPECIAL.search(text, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                c = text[i]
                i += 1
                if c == '"':
                    state = COLON if self.is_key else AFTER
                elif c == "\\":
                    state = ESC
                else:  # raw control character inside a string: not JSON
                    state = ERR
                    break
                if state == AFTER and not stack:
                    state = DONE
                    break
                continue
            if state == ESC:
                c = text[i]
                i += 1
                if c == "u":
                    state, self.hex_left = UHEX, 4
                elif c in '"\\/bfnrt':
                    state = STR
                else:
                    state = ERR
                    break
                continue
            if state == UHEX:
                c = text[i]
                i += 1
                if c not in _HEX:
                    state = ERR
                    break
                self.hex_left -= 1
                if not self.hex_left:
                    state = STR
                continue
            if state == LIT:
                m = _LIT_CHARS.match(text, i)
                j = m.end()
                self.lit.append(text[i:j])
                i = j
                if i >= n:
                    break
                tok = "".join(self.lit)
                self.lit = []
                if not _LITERAL.fullmatch(tok):
                    state = ERR
                    break
                state = AFTER
                if not stack:
                    state = DONE
                    break
                continue
            # structural states: skip whitespace first
            i = _WS.match(text, i).end()
            if i >= n:
                break
            c = text[i]
            if state == VAL or state == ARR_FIRST:
                if c == "{":
                    stack.append("{")
                    state = OBJ_FIRST
                    i += 1
                elif c == "[":
                    stack.append("[")
                    state = ARR_FIRST
                    i += 1
                elif c == '"':
                    self.is_key = False
                    state = STR
                    i += 1
                elif c == "]" and state == ARR_FIRST:
                    stack.pop()
                    i += 1
                    state = AFTER if stack else DONE
                    if state == DONE:
                        break
                elif c == "-" or c.isalnum():
                    state = LIT
                else:
                    state = ERR
                    break
            elif state == OBJ_FIRST or state == OBJ_KEY:
                if c == '"':
                    self.is_key = True
                    state = STR
                    i += 1
                elif c == "}" and state == OBJ_FIRST:
                    stack.pop()
                    i += 1
                    state = AFTER if stack else DONE
                    if state == DONE:
                        break
                else:
                    state = ERR
                    break
            elif state == COLON:
                if c != ":":
                    state = ERR
                    break
                i += 1
                state = VAL
            elif state == AFTER:
                top = stack[-1]
                if c == ",":
                    state = OBJ_KEY if top == "{" else VAL
                    i += 1
                elif (c == "}" and top == "{") or (c == "]" and top == "["):
                    stack.pop()
                    i += 1
                    if not stack:
                        state = DONE
                        break
                else:
                    state = ERR
                    break
            else:  # DONE or ERR: nothing more may be fed
                state = ERR
                break
        self.state = state
        if state == DONE:
            return i
        if state == ERR:
            return ERROR
        return NEED_MORE


_encode_basestring = json.encoder.encode_basestring  # the C escaper json.dumps uses, without its setup cost


def json_string_chunk(s: str) -> str:
    """`s` escaped as the inside of a JSON string (no quotes); chunks concatenate to the escaped whole."""
    return _encode_basestring(s)[1:-1]
