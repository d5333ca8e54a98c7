"""Engine for XML function/parameter formats: qwen3_coder/qwen3_xml/nemotron_nano, minimax_m2, glm45/glm47,
deepseek_v32/v4 (DSML).

Arguments stream as they are generated: at a string-typed parameter we emit `{"key": "` once, then each value
chunk JSON-escaped, then `"` at the close tag. Only values the tool's schema types as non-strings (numbers,
booleans, objects, arrays) are buffered — that one value — and converted when it closes. No step looks at
anything but the current delta plus a marker-sized hold-back.

A call cut off by the end of the stream is abandoned (no ToolCallEnd, no value guessed) and the text it consumed
is released as text, so the non-streaming answer loses nothing the model wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from serve_app.parsers.jsonscan import json_string_chunk
from serve_app.parsers.markers import Matcher
from serve_app.parsers.schema import ToolSchemas, coerce, coerce_marked_json, decode_or_string
from serve_app.parsers.section import FedSectionEngine
from serve_app.parsers.sink import Sink

HEAD_CAP = 512


_NAME = re.compile(r"[\w.\-:/]+")


def strip_name(head: str) -> str:
    """A function or parameter name, unquoted; "" when the head is not a name (then the markup was text)."""
    name = head.strip().strip("\"'").strip()
    return name if _NAME.fullmatch(name) else ""


_ATTR = re.compile(r'(\w+)\s*=\s*"([^"]*)"')


def dsml_param(head: str) -> tuple[str, str | None]:
    attrs = dict(_ATTR.findall(head))
    mode = None
    if "string" in attrs:
        mode = "string" if attrs["string"].lower() == "true" else "json"
    return attrs.get("name", strip_name(head)), mode


def plain_param(head: str) -> tuple[str, str | None]:
    return strip_name(head), None


def _xtml_attrs(head: str) -> dict[str, str]:
    # Kimi K3's template escapes `&` and `"` in attribute values (in that order): undone in reverse
    return {k: v.replace("&quot;", '"').replace("&amp;", "&") for k, v in _ATTR.findall(head)}


def xtml_name(head: str) -> str:
    """Kimi K3's call head, ` tool="NAME" index="N"`: the tool's name ("" when the head names none)."""
    return _xtml_attrs(head).get("tool", "").strip()


def xtml_param(head: str) -> tuple[str, str | None]:
    """Kimi K3's argument head, ` key="K" type="T"`: a `string` value is its raw text, any other type JSON."""
    attrs = _xtml_attrs(head)
    return attrs.get("key", ""), "string" if attrs.get("type", "string") == "string" else "json"


@dataclass(frozen=True, slots=True)
class XmlFormat:
    name: str
    starts: tuple[str, ...]  # section start markers (top level)
    section_end: str
    func_open: str | None  # None: the function name follows the section start directly (glm47)
    func_head_end: str  # ends the function head (the name); for glm47 the name ends at param_open/section_end
    func_close: str | None
    param_open: str
    param_head_end: str
    value_close: str
    value_open: str | None = None  # glm47: <arg_key>K</arg_key><arg_value>V</arg_value>
    implicit_closes: tuple[str, ...] = ()  # markers that end a value without its close tag (vLLM's qwen3 rule)
    name_of: Callable[[str], str] = strip_name
    param_of: Callable[[str], tuple[str, str | None]] = plain_param
    # a lone parameter of one of these names (not in the tool's schema) holding a JSON object is the whole
    # arguments object, wrapped (DeepSeek V3.2/V4 write <parameter name="arguments">{...}</parameter>)
    unwrap_params: tuple[str, ...] = ()
    # a value no schema describes (an unknown tool or parameter) is a string, not decoded as JSON: MiniMax-M2's
    # own rule (its reference parser and vLLM's type it "string" by default); the other formats decode it
    undescribed_string: bool = False
    # the family's think block, inside which no call is looked for: Seed-OSS reasons about the call format in it
    # (vLLM's seed_oss parser skips it too). Without a reasoning parser the block is plain text.
    think: tuple[str, str] | None = None
    # the templates put a value on its own lines (<parameter=k>\nV\n</parameter>): one newline at each end is
    # layout, not value; Kimi K3 writes values raw, every character theirs
    value_newlines: bool = True
    # markup around the answer that is dropped from the text even without the family's reasoning parser
    markup: tuple[str, ...] = ()
    # (open, close) of an element whose body is a JSON object of arguments (Kimi K3's `<|open|>json ...<|sep|>`,
    # what its template writes for arguments given as a string); its head ends at param_head_end
    json_block: tuple[str, str] | None = None
    special_tokens: bool = False
    harmony: ClassVar[bool] = False  # not a whole-stream format (see formats.HarmonyFormat)

    def engine(self, schemas: ToolSchemas) -> XmlEngine:
        """The per-request engine for this format; the schemas type the parameter values."""
        return XmlEngine(self, schemas)


SEC, FHEAD, FBODY, PHEAD, VOPEN, PVAL, OVER = range(7)


class XmlEngine(FedSectionEngine):
    OVER = OVER

    def __init__(self, fmt: XmlFormat, schemas: ToolSchemas):
        self.fmt = fmt
        self.schemas = schemas
        f = fmt
        self.sec_m = Matcher([m for m in (f.func_open, f.section_end) if m])
        fhead_ends = [f.func_head_end] if f.func_open else [f.param_open, f.section_end]
        self.fhead_m = Matcher(fhead_ends)
        block = f.json_block or ()
        self.body_m = Matcher([m for m in (f.param_open, *block[:1], f.func_close, f.section_end) if m])
        self.phead_m = Matcher([f.param_head_end])
        self.vopen_m = Matcher([f.value_open] if f.value_open else [])
        self.val_m = Matcher([f.value_close, *block[1:], f.section_end, *f.implicit_closes])
        self.section_end = f.section_end
        self.layout = f.value_newlines  # read once per value chunk
        self.state = OVER
        self.degraded = False
        self.steps = (self.step_section, self._step_fhead, self._step_fbody, self._step_phead, self._step_vopen,
                      self._step_pval)

    def open(self, marker: str) -> None:
        self.degraded = False
        self.hold = ""
        self.raw = [marker]  # text before the call is committed (its start), released if malformed
        self.mark_idx = 0  # index in `raw` of the section marker while no call of this section has completed
        self.call_raw = [marker]  # all text since the last completed call: released as text if the stream ends
        self._reset_call()
        # a section marker leads to the calls; a bare function marker (Qwen3-Coder without <tool_call>) is one
        self.state = SEC if self.fmt.func_open and marker != self.fmt.func_open else FHEAD

    def _reset_call(self) -> None:
        self.head = ""
        self.idx = -1
        self.fname = ""
        self.nparams = 0
        self.vmode = "string"
        self.vkey = ""
        self.vbuf: list[str] = []
        self.vseen = False
        self.pending_nl = ""
        self.wrap_mode = ""
        self.deferred: tuple[str, str] | None = None  # a lone wrapper parameter: (as a parameter, unwrapped)
        self.in_block = False  # the element being read is a JSON block (XmlFormat.json_block)
        self.bad_block = False  # a JSON block that is not an object: the call is abandoned at its end

    # -- call pieces --------------------------------------------------------------------------------------------
    def _start_value(self, sink: Sink, head: str) -> None:
        key, mode = self.fmt.param_of(head)
        if mode is None:
            if self.schemas.nullable_string(self.fname, key):
                mode = "nstring"  # held while it may still be `null`, then streamed
            else:
                mode = "string" if self.schemas.streams_as_string(self.fname, key) or (
                    self.fmt.undescribed_string and not self.schemas.types(self.fname, key)) else "typed"
        if self.deferred:  # the wrapper was not alone: it is an ordinary parameter after all
            sink.args(self.idx, "{" + self.deferred[0])
            self.deferred = None
        if self.nparams == 0 and key in self.fmt.unwrap_params and not self.schemas.declares(self.fname, key):
            self.wrap_mode, mode = mode, "wrap"
        self.vmode, self.vkey = mode, key
        self.vbuf = []
        self.vseen = False
        self.pending_nl = ""
        if mode == "string":
            sink.args(self.idx, self._sep() + json.dumps(key, ensure_ascii=False) + ': "')
        self.nparams += 1

    def _sep(self) -> str:
        return "{" if self.nparams == 0 else ", "

    def _layout(self, c: str) -> str:
        """The templates put the value on its own lines (<parameter=k>\nV\n</parameter>): drop one newline at each
        end, holding a trailing one back until we know it is not the last character."""
        if not self.vseen and c:
            self.vseen = True
            if c[0] == "\n":
                c = c[1:]
        if self.pending_nl:
            c = "\n" + c
            self.pending_nl = ""
        if c.endswith("\n"):
            self.pending_nl = "\n"
            c = c[:-1]
        return c

    def _value_chunk(self, sink: Sink, c: str) -> None:
        if self.layout:
            c = self._layout(c)
        if not c:
            return
        if self.vmode == "string":
            sink.args(self.idx, json_string_chunk(c))
            return
        self.vbuf.append(c)
        if self.vmode == "nstring":
            held = "".join(self.vbuf)
            if not ("null".startswith(held) or "None".startswith(held)):  # not null: stream it as the string it is
                self.nparams -= 1
                sink.args(self.idx, self._sep() + json.dumps(self.vkey, ensure_ascii=False) + ': "'
                          + json_string_chunk(held))
                self.nparams += 1
                self.vmode, self.vbuf = "string", []

    def _end_value(self, sink: Sink) -> None:
        if self.vmode == "string":
            sink.args(self.idx, '"')
            return
        raw = "".join(self.vbuf)
        if self.vmode == "nstring":
            val = "null" if raw in ("null", "None") else json.dumps(raw, ensure_ascii=False)  # None: Python's null
        elif self.vmode == "wrap":
            val = json.dumps(raw, ensure_ascii=False) if self.wrap_mode in ("string", "nstring") else (
                decode_or_string(raw) if self.wrap_mode == "json" else
                coerce(raw, self.schemas.types(self.fname, self.vkey)))
            inner = json.loads(val)
            if isinstance(inner, str):
                try:
                    inner = json.loads(inner)
                except ValueError:
                    pass
            if isinstance(inner, dict):  # maybe the whole arguments: decided when the call closes
                self.deferred = (json.dumps(self.vkey, ensure_ascii=False) + ": " + val,
                                 json.dumps(inner, ensure_ascii=False))
                return
        elif self.vmode == "json":
            val = coerce_marked_json(raw, self.schemas.types(self.fname, self.vkey))
        else:
            val = coerce(raw, self.schemas.types(self.fname, self.vkey))
        sep = "{" if self.nparams == 1 else ", "
        sink.args(self.idx, sep + json.dumps(self.vkey, ensure_ascii=False) + ": " + val)

    def _end_block(self, sink: Sink) -> None:
        """A JSON block's object joins the arguments; anything else makes the call malformed."""
        self.in_block = False
        try:
            obj = json.loads("".join(self.vbuf))
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            self.bad_block = True
            return
        inner = json.dumps(obj, ensure_ascii=False)[1:-1]
        if inner:
            sink.args(self.idx, self._sep() + inner)
            self.nparams += len(obj)

    def _end_call(self, sink: Sink, unconsumed: int) -> None:
        """Close the call; `unconsumed` characters of the text fed so far follow its end."""
        fed = self.take_fed(unconsumed)
        if self.bad_block:  # abandoned (no end): its text is given back, as for a call the stream cut off
            sink.plain(fed)
        else:
            if self.deferred:  # a lone wrapper parameter: its object is the arguments
                sink.args(self.idx, self.deferred[1])
            else:
                sink.args(self.idx, "}" if self.nparams else "{}")
            sink.end(self.idx)
        self.raw = []
        self.mark_idx = -1
        self._reset_call()

    # -- one step per state (the loop is SectionEngine.feed) -----------------------------------------------------
    def call_marker(self, mk: str) -> None:
        self.raw.append(mk)
        self.state = FHEAD

    def _head(self, m: Matcher, t: str, i: int) -> tuple[str, str, str] | None | bool:
        """Buffer a function or parameter head until `m` ends it: (head, end marker, rest); None to wait for
        more; False when it grew past HEAD_CAP without an end (it is left in `head`)."""
        old = len(self.head)
        self.head += t[i:]
        p, mk = m.search(self.head, max(0, old - 40))
        if p > HEAD_CAP:
            p = -1
        if p < 0:
            return False if len(self.head) > HEAD_CAP else None
        head, rest = self.head[:p], self.head[p + len(mk):]
        self.head = ""
        return head, mk, rest

    def _step_fhead(self, t: str, i: int, sink: Sink):
        """The function name: the call starts, or the markup was text."""
        got = self._head(self.fhead_m, t, i)
        if got is None:
            return None
        if got is False:
            return self.degrade(sink, self.head)
        head, mk, rest = got
        f = self.fmt
        name = f.name_of(head)
        if not name:
            self.raw.append(head)
            return self.degrade(sink, mk + rest)
        self.fname = name
        self.idx = sink.start(name)
        self.raw, self.mark_idx = [], -1
        if f.func_open:
            self.state = FBODY
        elif mk == f.section_end:  # glm47 call without arguments
            self._end_call(sink, len(rest))
            self.state = OVER
        else:  # glm47: the name ended at the first <arg_key>
            self.state = PHEAD
        return rest, 0

    def _step_phead(self, t: str, i: int, sink: Sink):
        """A parameter name: its value starts."""
        got = self._head(self.phead_m, t, i)
        if got is None:
            return None
        if got is False:
            self.state = OVER  # an unreadable parameter head inside a committed call: abandon it
            return self.head
        head, _, rest = got
        if self.in_block:
            self.vmode, self.vbuf = "block", []
        else:
            self._start_value(sink, head)
        self.state = VOPEN if self.fmt.value_open and not self.in_block else PVAL
        return rest, 0

    def _step_fbody(self, t: str, i: int, sink: Sink):
        """Inside a function, between parameters: the next parameter, or the call's end."""
        p, mk = self.find(self.body_m, t, i)
        if p < 0:
            return None
        i = p + len(mk)
        f = self.fmt
        if mk == f.param_open:
            self.state = PHEAD
        elif f.json_block and mk == f.json_block[0]:
            self.state, self.in_block = PHEAD, True
        else:
            self._end_call(sink, len(t) - i)
            self.state = OVER if mk == f.section_end else (SEC if f.func_open else FBODY)
        return t, i

    def _step_vopen(self, t: str, i: int, sink: Sink):
        """glm47: the value's own open tag after the key."""
        p, mk = self.find(self.vopen_m, t, i)
        if p < 0:
            return None
        self.state = PVAL
        return t, p + len(mk)

    def _step_pval(self, t: str, i: int, sink: Sink):
        """A value: chunks stream (or buffer, by type) up to its close tag or a marker that implies it."""
        m = self.val_m
        p, mk = m.search(t, i)
        if p < 0:
            h = m.hold_start(t, i)
            self._value_chunk(sink, t[i:h])
            self.hold = t[h:]
            return None
        self._value_chunk(sink, t[i:p])
        if self.in_block:
            self._end_block(sink)
        else:
            self._end_value(sink)
        f = self.fmt
        if mk == f.value_close or (f.json_block and mk == f.json_block[1]):
            i = p + len(mk)
            self.state = FBODY
        elif mk == f.section_end:
            i = p + len(mk)
            self._end_call(sink, len(t) - i)
            self.state = OVER
        else:  # implicit close: the marker belongs to what follows
            i = p
            self.state = FBODY
        return t, i
