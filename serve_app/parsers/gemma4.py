"""Engine for Gemma 4's tool calls: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:42,o:{k:[1,true]}}<tool_call|>`.

Gemma 4 writes its own notation, not JSON: keys are bare, strings sit between `<|"|>` delimiters (a special token,
so a string holds `"`, `{`, `,` as they are), numbers, `true`/`false`/`null` and anything else bare; objects and
arrays nest. Calls follow each other without a separator. The arguments are translated to JSON as they arrive:
structure and keys as soon as they are read, a string's text in chunks (JSON-escaped; only a suffix that may be
the start of `<|"|>` is held), a bare value once its terminator (`,` `}` `]`) shows it whole. So every streamed
prefix is a JSON prefix and a value cut off by the end of the stream is never guessed. The call ends at the `}`
that closes its arguments; the `<tool_call|>` after it is consumed.

Degradation, as in the tag engines: a head that is not `call:NAME{` leaves the marker as text and the text after
it is scanned again; arguments that break the notation abandon the call (no ToolCallEnd) and its text is released
and scanned again; a call cut off by the end of the stream is abandoned and its text released.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import ClassVar

import regex

from serve_app.parsers.sink import Sink

_HEAD = regex.compile(r"call:([\w.\-]+)\{")
HEAD_CAP = 256  # `call:NAME{` longer than this is not a call head
TOKEN_CAP = 1024  # a key or bare value longer than this is not one
DEPTH_CAP = 64
_WS_SEP = re.compile(r"[\s,]*")  # between members / elements: whitespace and commas (the model may double them)
_WS = re.compile(r"\s*")
_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_INT = re.compile(r"-?\d+")
_BARE_END = re.compile(r"[,}\]{\[]")


@dataclass(frozen=True, slots=True)
class Gemma4Format:
    name: str
    starts: tuple[str, ...] = ("<|tool_call>",)
    call_end: str = "<tool_call|>"
    delim: str = '<|"|>'  # Gemma 4's string delimiter token
    special_tokens: bool = True
    harmony: ClassVar[bool] = False  # not a whole-stream format (see formats.HarmonyFormat)

    def engine(self, schemas) -> Gemma4Engine:
        """The per-request engine for this format (the format declares it, `stream.py` just asks)."""
        return Gemma4Engine(self)


def bare_json(tok: str) -> str:
    """A bare value as JSON: a literal or a number as itself, anything else (vLLM's reading) as a string."""
    s = tok.strip()
    if s in ("true", "false"):
        return s
    if s.lower() in ("null", "none", "nil"):
        return "null"
    if _NUMBER.fullmatch(s):
        n = int(s) if _INT.fullmatch(s) else float(s)
        if n == n and n not in (float("inf"), float("-inf")):  # 1e999 is not a JSON number: a string
            return json.dumps(n)
    return json.dumps(s, ensure_ascii=False)


HEAD, KEY, VALUE, STRING, BARE, TAIL, OVER = range(7)


class Gemma4Engine:
    def __init__(self, fmt: Gemma4Format):
        self.fmt = fmt
        self.delim = fmt.delim
        self.dprefixes = tuple(fmt.delim[:k] for k in range(len(fmt.delim) - 1, 0, -1))  # longest first
        self.eprefixes = tuple(fmt.call_end[:k] for k in range(1, len(fmt.call_end)))
        self.state = OVER
        self.degraded = False
        # by state: HEAD, KEY, VALUE, STRING, BARE, TAIL
        self.steps = (self._step_head, self._step_key, self._step_value, self._step_string, self._step_bare,
                      self._step_tail)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def open(self, marker: str) -> None:
        self.marker = marker
        self.degraded = False
        self.state = HEAD
        self.raw: list[str] = []  # all text fed since the marker: released (and rescanned) if the call breaks
        self.tok = ""  # the head, a key, a bare value or a held partial delimiter, as it grows
        self.stack: list[list] = []  # per open object/array: [closer, members so far]
        self.idx = -1
        self.out: list[str] = []  # JSON produced by this feed

    def eof(self, sink: Sink) -> None:
        """End of stream inside a call: abandoned (its streamed prefix gets no ToolCallEnd), its text released.
        After a finished call only a possible partial end marker is held: text unless it is only whitespace."""
        self._flush(sink)
        if self.state == TAIL:
            if self.tok.strip():
                sink.plain(self.tok)
        elif self.state != OVER:
            sink.plain(self.marker + "".join(self.raw))
        self.raw, self.tok, self.state = [], "", OVER

    def feed(self, text: str, sink: Sink) -> str | None:
        """Consume `text`; None while the call goes on, else the text after it (maybe empty). Each step consumes
        from `text[i:]` in one state and returns `(text, i)` to go on, or what `feed` returns."""
        if self.state != TAIL:
            self.raw.append(text)
        steps = self.steps
        i = 0
        r = None
        while True:
            st = self.state
            if st == OVER:
                r = text[i:]
                break
            if i >= len(text):
                r = None
                break
            r = steps[st](text, i, sink)
            if r.__class__ is not tuple:
                break
            text, i = r
        self._flush(sink)
        return r

    # -- helpers ----------------------------------------------------------------------------------------------
    def _flush(self, sink: Sink) -> None:
        if self.out:
            sink.args(self.idx, "".join(self.out))
            self.out = []

    def _break(self, sink: Sink) -> str:
        """Not a call (head), or the notation broke (arguments): the marker is text and everything after it is
        scanned again as top-level text, so the outcome does not depend on how the deltas were split."""
        self._flush(sink)  # what was streamed stays without an End: the call is abandoned
        sink.plain(self.marker)
        rest = "".join(self.raw)
        self.raw, self.tok, self.stack = [], "", []
        self.degraded = True
        self.state = OVER
        return rest

    def _member(self) -> str:
        """The separator before the next member / element of the innermost container."""
        top = self.stack[-1]
        top[1] += 1
        return ", " if top[1] > 1 else ""

    def _close(self, sink: Sink, c: str):
        """`}` / `]` closes the innermost container; closing the arguments object ends the call."""
        self.stack.pop()
        self.out.append(c)
        if self.stack:
            self.state = KEY if self.stack[-1][0] == "}" else VALUE
            return True
        self._flush(sink)
        sink.end(self.idx)
        self.raw, self.tok = [], ""
        self.state = TAIL
        return True

    def _open(self, c: str) -> bool:
        if len(self.stack) >= DEPTH_CAP:
            return False
        self.out.append(c)
        self.stack.append(["}" if c == "{" else "]", 0])
        self.state = KEY if c == "{" else VALUE
        return True

    # -- one step per state -------------------------------------------------------------------------------------
    def _step_head(self, t: str, i: int, sink: Sink):
        """`call:NAME{`, matched as a whole on the buffered head."""
        h = self.tok = self.tok + t[i:]
        m = _HEAD.match(h, partial=True)
        if m is None or (m.partial and len(h) >= HEAD_CAP):
            return self._break(sink)
        if m.partial:
            return None
        self.tok = ""
        self.idx = sink.start(m.group(1))
        self._open("{")
        return h, m.end()

    def _step_key(self, t: str, i: int, sink: Sink):
        """Inside an object, before a key: separators, then `}` or `KEY:`."""
        if not self.tok:
            i = _WS_SEP.match(t, i).end()
            if i >= len(t):
                return None
            if t[i] == "}":
                return (t, i + 1) if self._close(sink, "}") else self._break(sink)
        j = t.find(":", i, i + TOKEN_CAP + 1)  # bounded: a key is short
        seg = t[i:] if j < 0 else t[i:j]
        if _BARE_END.search(seg) or len(self.tok) + len(seg) > TOKEN_CAP:
            return self._break(sink)  # `{a,b}`, `{a}`: not `key:value`
        self.tok += seg
        if j < 0:
            return None
        key = self.tok.strip()
        if len(key) > 2 * len(self.delim) and key.startswith(self.delim) and key.endswith(self.delim):
            key = key[len(self.delim):-len(self.delim)]
        self.tok = ""
        if not key:
            return self._break(sink)
        self.out.append(self._member() + json.dumps(key, ensure_ascii=False) + ": ")
        self.state = VALUE
        return t, j + 1

    def _step_value(self, t: str, i: int, sink: Sink):
        """A value: a string, an object, an array or a bare value. In an array: separators, then `]` or a value."""
        in_array = self.stack[-1][0] == "]"
        h = self.tok + t[i:]  # a held partial delimiter, continued
        self.tok = ""
        t, i = h, (_WS_SEP if in_array else _WS).match(h).end()
        if i >= len(t):
            return None
        c = t[i]
        if in_array and c == "]":
            return (t, i + 1) if self._close(sink, "]") else self._break(sink)
        if t.startswith(self.delim, i):
            self.out.append(self._member() + '"' if in_array else '"')
            self.state = STRING
            return t, i + len(self.delim)
        if self.delim.startswith(t[i:]):  # may still become the delimiter: wait
            self.tok = t[i:]
            return None
        if in_array:
            self.out.append(self._member())
        if c in "{[":
            return (t, i + 1) if self._open(c) else self._break(sink)
        self.state = BARE
        return t, i

    def _step_string(self, t: str, i: int, sink: Sink):
        """A string's text up to the closing delimiter; a suffix that may begin the delimiter is held."""
        h = self.tok + t[i:] if self.tok else t[i:]
        self.tok = ""
        p = h.find(self.delim)
        if p < 0:
            keep = next((len(d) for d in self.dprefixes if h.endswith(d)), 0)
            body = h[:len(h) - keep]
            self.tok = h[len(body):]
            if body:
                self.out.append(json.dumps(body, ensure_ascii=False)[1:-1])
            return None
        if p:
            self.out.append(json.dumps(h[:p], ensure_ascii=False)[1:-1])
        self.out.append('"')
        self.state = KEY if self.stack[-1][0] == "}" else VALUE
        return h, p + len(self.delim)

    def _step_bare(self, t: str, i: int, sink: Sink):
        """A bare value, converted once its terminator arrives (a number or `true` cut by a delta is not one yet)."""
        m = _BARE_END.search(t, i)
        seg = t[i:] if m is None else t[i:m.start()]
        self.tok += seg
        if len(self.tok) > TOKEN_CAP:
            return self._break(sink)
        if m is None:
            return None
        c = m.group()
        if c in "{[" or self.delim in self.tok:
            return self._break(sink)  # `a:x{` or a delimiter inside a bare value: not the notation
        self.out.append(bare_json(self.tok) if self.tok.strip() else '""')  # `key:,` is an empty value (vLLM)
        self.tok = ""
        closer = self.stack[-1][0]
        if c == ",":
            self.state = KEY if closer == "}" else VALUE
            return t, m.end()
        if c != closer:
            return self._break(sink)  # `]` closing an object, `}` an array
        return (t, m.end()) if self._close(sink, c) else self._break(sink)

    def _step_tail(self, t: str, i: int, sink: Sink):
        """After the arguments: whitespace and the end marker are consumed; anything else is text after the call."""
        h = self.tok + t[i:]
        self.tok = ""
        j = _WS.match(h).end()
        if h.startswith(self.fmt.call_end, j):
            self.state = OVER
            return h[j + len(self.fmt.call_end):]
        if (j >= len(h) or h[j:] in self.eprefixes) and len(h) <= HEAD_CAP:
            self.tok = h  # whitespace, maybe the start of the end marker: wait
            return None
        self.state = OVER
        return h
