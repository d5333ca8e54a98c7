"""Engine for formats whose arguments are XML elements named after them, nested for objects and arrays:
MiniMax-M3, where a namespace marker prefixes every structural tag,

    NS<tool_call>
    NS<invoke name="create_order">NS<user_id>42NS</user_id>NS<items>NS<item>NS<sku>b-1NS</sku>NSNS</item>NS</items>NS</invoke>
    NS</tool_call>

(NS = `]<]minimax[>[`; an element holding elements is an object, or an array where the schema says so, its items
written as `<item>`; a repeated name collects into a list).

A call starts at its invoke head; its arguments are emitted whole at its `</invoke>`: a value is not prefix-stable
while elements arrive (a repeated name turns a scalar already read into a list, an element inside a string makes
it an object), which is vLLM's reading too. Only the text before the close marker is buffered, and the search for
it holds back at most a marker-sized suffix, so work per delta stays O(Δ); the body is parsed once, at its end.

A body that is not a sequence of well-formed elements (a stray close tag, text outside an element, an element
without its close) abandons the call: no ToolCallEnd, and its text comes back as text, as for a call cut off by
the end of the stream. Nothing is guessed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from serve_app.parsers.markers import Matcher
from serve_app.parsers.schema import STRINGY, ToolSchemas, coerce, types_of
from serve_app.parsers.section import FedSectionEngine
from serve_app.parsers.sink import Sink
from serve_app.parsers.xml_tags import HEAD_CAP, strip_name

MAX_DEPTH = 128
_OPEN = re.compile(r"<([^\s<>/][^<>]*)>")  # an element's open tag after the namespace marker
TEXT_ONLY = STRINGY | {"null"}  # a value written as the text it is


@dataclass(frozen=True, slots=True)
class ElementFormat:
    """A tool format of nested argument elements. The markers are built from the namespace and the tag names."""

    name: str
    ns: str  # prefixes every structural tag
    section: str = "tool_call"
    invoke: str = "invoke"
    name_attr: str = "name"
    special_tokens: bool = False
    starts: tuple[str, ...] = field(init=False)
    section_end: str = field(init=False)
    call_open: str = field(init=False)
    call_close: str = field(init=False)
    harmony: ClassVar[bool] = False  # not a whole-stream format (see formats.HarmonyFormat)

    def __post_init__(self) -> None:
        ns = self.ns
        object.__setattr__(self, "starts", (f"{ns}<{self.section}>",))
        object.__setattr__(self, "section_end", f"{ns}</{self.section}>")
        object.__setattr__(self, "call_open", f"{ns}<{self.invoke} {self.name_attr}=")
        object.__setattr__(self, "call_close", f"{ns}</{self.invoke}>")

    def engine(self, schemas: ToolSchemas) -> ElementEngine:
        return ElementEngine(self, schemas)


# -- the body: elements, then their values by schema ------------------------------------------------------------------

Element = Any  # str (text only) or list[tuple[str, Element]] (children, in order)


def _element(s: str, i: int, name: str, ns: str, depth: int) -> tuple[Element, int] | None:
    """The content of element `name` whose open tag ends at `i`: (value, index after its close tag), or None when
    it is malformed or not closed."""
    close = f"{ns}</{name}>"
    texts: list[str] = []
    kids: list[tuple[str, Element]] = []
    while True:
        j = s.find(ns, i)
        if j < 0:
            return None
        texts.append(s[i:j])
        if s.startswith(close, j):
            i = j + len(close)
            break
        m = _OPEN.match(s, j + len(ns))
        if m is None or depth >= MAX_DEPTH:
            return None
        got = _element(s, m.end(), m.group(1), ns, depth + 1)
        if got is None:
            return None
        kids.append((m.group(1), got[0]))
        i = got[1]
    text = "".join(texts)
    if not kids:
        return text, i
    if text.strip():  # text beside elements is kept, under a key no element uses (vLLM's `$text`)
        key = "$text"
        while any(k == key for k, _ in kids):
            key = "$" + key
        kids.append((key, text))
    return kids, i


def parse_elements(body: str, ns: str) -> list[tuple[str, Element]] | None:
    """An invoke's body as (name, value) pairs; None unless it is only elements (whitespace between them)."""
    out: list[tuple[str, Element]] = []
    i, n = 0, len(body)
    while True:
        while i < n and body[i].isspace():
            i += 1
        if i == n:
            return out
        if not body.startswith(ns, i):
            return None
        m = _OPEN.match(body, i + len(ns))
        if m is None:
            return None
        got = _element(body, m.end(), m.group(1), ns, 1)
        if got is None:
            return None
        out.append((m.group(1), got[0]))
        i = got[1]


def schema_container(schema: dict) -> tuple[str, dict] | None:
    """The schema's first array or object alternative: ("array" | "object", that schema)."""
    t = schema.get("type")
    for kind in ("array", "object"):
        if t == kind or (isinstance(t, list) and kind in t):
            return kind, schema
    if t is None:
        if "items" in schema:
            return "array", schema
        if "properties" in schema or "additionalProperties" in schema:
            return "object", schema
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            if isinstance(sub, dict) and (got := schema_container(sub)):
                return got
    return None


def _scalar(raw: str, schema: dict) -> Any:
    types = types_of(schema)
    if "null" in types and raw.strip().lower() == "null":
        return None
    if not types or not types - TEXT_ONLY:  # a string (or undescribed): every character is the model's
        return raw
    return json.loads(coerce(raw, types))


def convert(value: Element, schema: Any) -> Any:
    """An element's value typed by its schema: text by the scalar type (a string where none is given), children as
    an object, or as an array where the schema says so (item names are not keys then)."""
    schema = schema if isinstance(schema, dict) else None
    box = schema_container(schema) if schema is not None else None
    if isinstance(value, str):
        if schema is None:
            return value
        if box is not None and not types_of(schema) & STRINGY and not value.strip():
            return [] if box[0] == "array" else {}  # the template writes an empty list or object as nothing
        return _scalar(value, schema)
    if schema is None and all(k == "item" for k, _ in value):
        # undescribed, its elements all `item`: the template's list (vLLM reads {"item": [...]}, which renders back
        # differently, so the next prompt would not reproduce what the model wrote)
        return [convert(v, None) for _, v in value]
    if box is not None and box[0] == "array":  # (value is a list of elements here)
        items = box[1].get("items")
        return [convert(v, items) for _, v in value]
    return convert_object(value, box[1] if box is not None else None)


def convert_object(pairs: list[tuple[str, Element]], schema: dict | None) -> dict[str, Any]:
    """Named elements as an object; a name that repeats collects its values into a list."""
    props = (schema or {}).get("properties") or {}
    extra = (schema or {}).get("additionalProperties")
    out: dict[str, Any] = {}
    lists: set[str] = set()
    for key, val in pairs:
        v = convert(val, props.get(key, extra))
        if key not in out:
            out[key] = v
        elif key in lists:
            out[key].append(v)
        else:
            out[key] = [out[key], v]
            lists.add(key)
    return out


# -- the engine --------------------------------------------------------------------------------------------------------

SEC, HEAD, BODY, OVER = range(4)


class ElementEngine(FedSectionEngine):
    OVER = OVER

    def __init__(self, fmt: ElementFormat, schemas: ToolSchemas):
        self.fmt = fmt
        self.schemas = schemas
        self.sec_m = Matcher([fmt.call_open, fmt.section_end])
        self.body_m = Matcher([fmt.call_close, fmt.section_end])
        self.section_end = fmt.section_end
        self.state = OVER
        self.degraded = False
        self.steps = (self.step_section, self._step_head, self._step_body)

    def open(self, marker: str) -> None:
        self.degraded = False
        self.hold = ""
        self.raw = [marker]  # text before the call is committed, released if its head is not a call
        self.mark_idx = 0
        self.call_raw = [marker]  # all text since the last completed call: released as text if the call fails
        self.calls = 0  # calls of this section completed so far
        self.gave_back = False  # a call was given back as text: so is the section's end, unless a call completes
        self._reset_call()
        self.state = SEC

    def _reset_call(self) -> None:
        self.head = ""
        self.idx = -1
        self.fname = ""
        self.body: list[str] = []

    def call_marker(self, mk: str) -> None:
        self.raw.append(mk)
        self.state = HEAD

    def step_section(self, t: str, i: int, sink: Sink):
        """Between calls (SectionEngine's); a section whose only calls were given back as text is text to its end,
        its close marker included, as its open marker was."""
        r = super().step_section(t, i, sink)
        if self.state == OVER and self.gave_back and not self.degraded and r.__class__ is tuple:
            self._release(sink, r[0], r[1])
        return r

    def _release(self, sink: Sink, t: str, i: int) -> None:
        """Give everything fed up to `t[i:]` since the last completed call back as text."""
        sink.plain(self.take_fed(len(t) - i))

    def _step_head(self, t: str, i: int, sink: Sink):
        """`"NAME">`: the call starts, or the markup was text."""
        old = len(self.head)
        self.head += t[i:]
        p = self.head.find(">", max(0, old - 1))
        if p < 0 or p > HEAD_CAP:
            return self.degrade(sink, self.head) if len(self.head) > HEAD_CAP else None
        head, rest = self.head[:p], self.head[p + 1:]
        self.head = ""
        name = strip_name(head)
        if not name:
            self.raw.append(head)
            return self.degrade(sink, ">" + rest)
        self.fname = name
        self.idx = sink.start(name)
        self.raw, self.mark_idx = [], -1
        self.state = BODY
        return rest, 0

    def _step_body(self, t: str, i: int, sink: Sink):
        """Buffer the arguments up to the call's close; then emit them whole, or give the call's text back."""
        p, mk = self.body_m.search(t, i)
        if p < 0:
            h = self.body_m.hold_start(t, i)
            self.body.append(t[i:h])
            self.hold = t[h:]
            return None
        self.body.append(t[i:p])
        i = p + len(mk)
        args = None
        if mk == self.fmt.call_close:
            pairs = parse_elements("".join(self.body), self.fmt.ns)
            if pairs is not None:
                args = convert_object(pairs, {"properties": self.schemas.properties(self.fname)})
        if args is None:  # malformed, or the section ended inside the call: abandoned, its text is text
            self._release(sink, t, i)
            self.gave_back = not self.calls
        else:
            sink.args(self.idx, json.dumps(args, ensure_ascii=False))
            sink.end(self.idx)
            self.calls += 1
            self.gave_back = False
            self.take_fed(len(t) - i)
        self.raw, self.mark_idx = [], -1
        self._reset_call()
        self.state = SEC if mk == self.fmt.call_close else OVER
        return t, i
