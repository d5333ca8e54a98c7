"""Engine for the pythonic formats: a list of calls (`[get_weather(city="SF"), f(x=1)]`, Llama 3.2/4, ToolACE), the
same list after Llama 4's `<|python_start|>`, and OLMo 3's calls one per line inside `<function_calls>` (no list
brackets).

A bare list may only open the text; a start marker may come anywhere. Each call is emitted when its closing
parenthesis arrives: its keyword arguments are Python literals, converted once with `ast.literal_eval` (no
partial-literal guessing). The bracket and quote tracking is incremental: each character is looked at once. A
call cut off by the end of the stream is never emitted; its raw text is given back as text.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import ClassVar

from serve_app.parsers.sink import Sink

_CALL_HEAD = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*\(")
_CALL_HEAD_PARTIAL = re.compile(r"\s*(?:[A-Za-z_][\w.\-]*\s*)?$")
_JSON_NAMES = {"null": None, "true": True, "false": False}
CALL_CAP = 1 << 20
HEAD_CAP = 256


@dataclass(frozen=True, slots=True)
class PythonicFormat:
    name: str
    bare_start: str | None = "["
    starts: tuple[str, ...] = ()
    special_tokens: bool = False
    # OLMo 3: no list brackets; calls one per line (whitespace or commas between them)
    bracketless: bool = False
    # the marker that closes the section when it follows the calls (`</function_calls>`, `<|python_end|>`)
    section_end: str = ""
    # JSON's null/true/false as values (OLMo 3 writes them; Python's None/True/False are read too)
    json_literals: bool = False
    harmony: ClassVar[bool] = False  # not a whole-stream format (see formats.HarmonyFormat)

    def engine(self, schemas) -> PythonicEngine:
        """The per-request engine for this format (the format declares it, `stream.py` just asks)."""
        return PythonicEngine(self)


class _JsonNames(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in _JSON_NAMES:
            return ast.copy_location(ast.Constant(_JSON_NAMES[node.id]), node)
        return node


LIST_HEAD, CALL, BETWEEN, END, OVER = range(5)


class PythonicEngine:
    def __init__(self, fmt: PythonicFormat):
        self.fmt = fmt
        self.end = fmt.section_end
        self.state = OVER
        self.degraded = False
        # by state: LIST_HEAD, CALL, BETWEEN, END
        self.steps = (self._step_list_head, self._step_call, self._step_between, self._step_end)

    def open(self, marker: str) -> None:
        self.lead = marker  # the start marker, or the whitespace before a bare list: given back if it is text
        self.degraded = False
        self.state = LIST_HEAD
        # raw text since the section opened or the last call closed, not yet a call (given back if it is text)
        self.head = ""
        self.pre = ""  # the raw text before the current call's name (bracket, separators)
        self.buf: list[str] = []  # the current call's text, from its name
        self.ncalls = 0
        self.depth = 0
        self.quote = ""
        self.esc = False

    def eof(self, sink: Sink) -> None:
        """Nothing complete is pending: what was held back is text (a cut-off call is never emitted)."""
        st = self.state
        if st == OVER:
            return
        raw = self.pre + "".join(self.buf) if st == CALL else self.head
        if self.ncalls == 0:
            sink.plain(self.lead + raw)
        elif raw.strip():  # whitespace after a call is its separator (the composite drops it the same way)
            sink.plain(raw)

    def _degrade(self, sink: Sink, raw: str) -> str:
        """Not a call after all: the opening marker is text, and what followed it is handed back to be scanned
        again as text (so where the deltas split does not matter)."""
        sink.plain(self.lead)
        self.degraded = True
        self.state = OVER
        return raw

    def _literal(self, node: ast.expr):
        if self.fmt.json_literals:
            node = _JsonNames().visit(node)
        return ast.literal_eval(node)

    def _emit_call(self, sink: Sink, src: str) -> bool:
        try:
            node = ast.parse(src.strip(), mode="eval").body
            if not isinstance(node, ast.Call) or node.args:
                return False
            name = ast.unparse(node.func)
            args = {kw.arg: self._literal(kw.value) for kw in node.keywords if kw.arg}
            text = json.dumps(args, ensure_ascii=False)
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return False
        idx = sink.start(name)
        sink.args(idx, text)
        sink.end(idx)
        self.ncalls += 1
        return True

    def feed(self, text: str, sink: Sink) -> str | None:
        """Consume `text`; None while the section goes on, else the text after it. Each step consumes from
        `text[i:]` in one state and returns `(text, i)` to go on or what `feed` returns."""
        steps = self.steps
        i = 0
        while i < len(text):
            st = self.state
            if st == OVER:
                return text[i:]
            r = steps[st](text, i, sink)
            if r.__class__ is not tuple:
                return r
            text, i = r
        return None

    def _step_list_head(self, text: str, i: int, sink: Sink):
        """The list's `[` (whitespace may come first; none in the bracketless format), then the first call's head."""
        h = self.head = self.head + text[i:]
        j = len(h) - len(h.lstrip())
        if j >= len(h):
            return None
        if not self.fmt.bracketless:
            if h[j] != "[":
                return self._degrade(sink, h)
            j += 1
        return self._call_head(sink, h, j)

    def _step_between(self, text: str, i: int, sink: Sink):
        """After a call: the separator and the next call's head, the list's `]`, the section's end marker, or junk
        that ends the calls."""
        h = self.head = self.head + text[i:]
        bracketless = self.fmt.bracketless
        s = h.lstrip(" \t\r\n,") if bracketless else h.lstrip()
        if not s:
            return None
        if bracketless and self.end:
            if s.startswith(self.end):
                self.state = OVER
                return s[len(self.end):]
            if self.end.startswith(s):
                return None  # may still grow into the end marker
        if not bracketless:
            if s[0] == "]":
                self.head = ""
                if self.end:
                    self.state = END
                    return s, 1
                self.state = OVER
                return s[1:]
            if s[0] != ",":
                self.state = OVER  # junk after a call: the list is over
                return h
            s = s[1:]
        return self._call_head(sink, h, len(h) - len(s))

    def _step_end(self, text: str, i: int, sink: Sink):
        """After the list's `]`: the section's end marker is consumed when it follows."""
        h = self.head = self.head + text[i:]
        s = h.lstrip()
        if s.startswith(self.end):
            self.state = OVER
            return s[len(self.end):]
        if not s or self.end.startswith(s):
            return None  # whitespace, or what may still grow into the end marker
        self.state = OVER
        return h

    def _call_head(self, sink: Sink, h: str, k: int):
        """`NAME(` at `h[k:]` opens a call; a head that may still grow into one waits (bounded)."""
        m = _CALL_HEAD.match(h, k)
        if m is not None and m.end() - k > HEAD_CAP:
            m = None
        if m is None:
            if _CALL_HEAD_PARTIAL.match(h, k) and len(h) - k < HEAD_CAP:
                return None
            if self.ncalls == 0:
                return self._degrade(sink, h)
            self.state = OVER
            return h
        self.state = CALL
        self.pre = h[: m.start(1)]
        self.buf = [h[m.start(1): m.end()]]
        self.buflen = m.end() - m.start(1)
        self.depth = 1
        self.quote = ""
        self.esc = False
        self.head = ""
        return h[m.end():], 0

    def _step_call(self, text: str, i: int, sink: Sink):
        """Inside a call: brackets and quotes are tracked one character at a time up to the closing `)`."""
        n = len(text)
        j = i
        depth, quote, esc = self.depth, self.quote, self.esc
        while j < n:
            c = text[j]
            j += 1
            if quote:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == quote:
                    quote = ""
            elif c in "\"'":
                quote = c
            elif c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
                if depth == 0:
                    break
        self.depth, self.quote, self.esc = depth, quote, esc
        self.buf.append(text[i:j])
        self.buflen += j - i
        i = j
        if depth:
            if self.buflen > CALL_CAP:
                raw = self.pre + "".join(self.buf) + text[i:]
                if self.ncalls == 0:
                    return self._degrade(sink, raw)
                self.state = OVER
                return raw
            return None
        src = "".join(self.buf)
        self.buf = []
        if not self._emit_call(sink, src):
            if self.ncalls == 0:
                return self._degrade(sink, self.pre + src + text[i:])
            self.state = OVER
            return self.pre + src + text[i:]
        self.state = BETWEEN
        self.head = ""
        self.pre = ""
        return text, i
