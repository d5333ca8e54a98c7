"""Engine for the pythonic format (`[get_weather(city="SF"), f(x=1)]`, Llama 3.2/4, ToolACE).

A list of calls may only open the text. Each call is emitted when its closing parenthesis arrives: its keyword
arguments are Python literals, converted once with `ast.literal_eval` (no partial-literal guessing). The bracket
and quote tracking is incremental: each character is looked at once.
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
CALL_CAP = 1 << 20


@dataclass(frozen=True, slots=True)
class PythonicFormat:
    name: str
    bare_start: str = "["
    starts: tuple[str, ...] = ()
    special_tokens: bool = False
    harmony: ClassVar[bool] = False  # not a whole-stream format (see formats.HarmonyFormat)

    def engine(self, schemas) -> PythonicEngine:
        """The per-request engine for this format (the format declares it, `stream.py` just asks)."""
        return PythonicEngine(self)


LIST_HEAD, CALL, BETWEEN, OVER = range(4)


class PythonicEngine:
    def __init__(self, fmt: PythonicFormat):
        self.fmt = fmt
        self.state = OVER
        self.degraded = False
        self.steps = (self._step_list_head, self._step_call, self._step_between)  # by state: LIST_HEAD, CALL, BETWEEN

    def open(self, marker: str) -> None:
        self.lead = marker  # whitespace before the list: given back if it turns out to be text
        self.degraded = False
        self.state = LIST_HEAD
        self.buf: list[str] = []  # the current call's text
        self.head = ""
        self.ncalls = 0
        self.depth = 0
        self.quote = ""
        self.esc = False
        self.seen_bracket = False

    def eof(self, sink: Sink) -> None:
        if self.ncalls == 0 and self.state == LIST_HEAD:
            sink.plain(self.lead + ("[" if self.seen_bracket else "") + self.head)  # "[word" at the end: text

    def _degrade(self, sink: Sink, rest: str) -> str:
        sink.plain(self.lead + rest if self.ncalls == 0 else rest)
        self.degraded = True
        self.state = OVER
        return ""

    def _emit_call(self, sink: Sink, src: str) -> bool:
        try:
            node = ast.parse(src.strip(), mode="eval").body
            if not isinstance(node, ast.Call) or node.args:
                return False
            name = ast.unparse(node.func)
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            text = json.dumps(args, ensure_ascii=False)
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return False
        idx = sink.start(name)
        sink.args(idx, text)
        sink.end(idx)
        self.ncalls += 1
        return True

    def feed(self, text: str, sink: Sink) -> str | None:
        """Consume `text`; None while the list goes on, else the text after it. Each step consumes from `text[i:]`
        in one state and returns `(text, i)` to go on or what `feed` returns."""
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
        """The list's `[` (whitespace may come first), then the first call's head."""
        h = self.head = self.head + text[i:]
        if not self.seen_bracket:
            j = len(h) - len(h.lstrip())
            if j >= len(h):
                return None
            if h[j] != "[":
                return self._degrade(sink, h)
            self.seen_bracket = True
            h = self.head = h[j + 1:]
        return self._call_head(sink, h)

    def _step_between(self, text: str, i: int, sink: Sink):
        """After a call: `,` and the next call's head, `]`, or junk that ends the list."""
        self.head += text[i:]
        s = self.head.lstrip()
        if not s:
            return None
        if s[0] == "]":
            self.state = OVER
            return s[1:]
        if s[0] != ",":
            self.state = OVER  # junk after a call: the list is over
            return s
        self.head = s[1:]
        return self._call_head(sink, self.head)

    def _call_head(self, sink: Sink, h: str):
        """`NAME(` opens a call; a head that may still grow into one waits (bounded)."""
        m = _CALL_HEAD.match(h)
        if m is not None and m.end() > 256:
            m = None
        if m is None:
            if _CALL_HEAD_PARTIAL.match(h) and len(h) < 256:
                self.state = LIST_HEAD
                return None
            if self.ncalls == 0:
                return self._degrade(sink, "[" + h)
            self.state = OVER
            return h
        self.state = CALL
        self.buf = [h[: m.end()]]
        self.buflen = m.end()
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
                return self._degrade(sink, "".join(self.buf) + text[i:])
            return None
        src = "".join(self.buf)
        self.buf = []
        if not self._emit_call(sink, src):
            if self.ncalls == 0:
                return self._degrade(sink, "[" + src + text[i:])
            self.state = OVER
            return src + text[i:]
        self.state = BETWEEN
        self.head = ""
        return text, i
