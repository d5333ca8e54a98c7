"""Engine for JSON-in-tags formats: hermes/qwen3_json, llama3_json, mistral, deepseek_v3/v31, kimi_k2, phi4_mini_json,
MiniMax-M1, Hunyuan-A13B, Jamba, Granite, InternLM2, ERNIE 4.5, GigaChat 3.

A call is a name (inside a `{"name": .., "arguments": ..}` wrapper, or in a head before a separator marker) and
an arguments JSON object. Streaming choice: the name is buffered (it is short); then the arguments object's text
is forwarded raw as it arrives while a `JsonScanner` tracks its structure, so we know where it closes without
re-parsing, and every forwarded prefix is a valid JSON prefix. Degradation:
- malformed before the arguments start (no wrapper, no name, arguments not an object): the call's raw text,
  markers included, is released as text and parsing resumes after it;
- malformed inside the streamed arguments: the call is abandoned (no ToolCallEnd — consumers drop it, like a
  call cut off by the end of the stream) and its raw text is released as text;
- inside a section of several calls (Kimi, DeepSeek): a call whose head or arguments are malformed is abandoned and
  skipped up to its end marker, and the section goes on — the calls after it still count and no markup leaks;
- cut off by the end of the stream: abandoned, nothing is guessed; its raw text is released as text (nothing the
  model wrote is lost from the non-streaming answer).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import regex

from serve_app.parsers.jsonscan import AFTER, ERROR, NEED_MORE, JsonScanner
from serve_app.parsers.markers import Matcher
from serve_app.parsers.section import NOISE_CAP, SectionEngine
from serve_app.parsers.sink import Sink

_WS = re.compile(r"\s*")
_JSON_STR = r'"((?:[^"\\]|\\.)*)"'
# {"name": "F", "arguments": <value follows>   |   {"name": "F"}   |   {"arguments": <value; name comes after>
_WRAP_HEAD = regex.compile(
    r'\s*\{\s*"name"\s*:\s*' + _JSON_STR + r'\s*(?:,\s*"(?:arguments|parameters)"\s*:\s*|(\}))'
    r'|\s*\{\s*"(?:arguments|parameters)"\s*:\s*(?P<argsfirst>)'
)
_WRAP_TAIL_NAME = regex.compile(r'\s*,\s*"name"\s*:\s*' + _JSON_STR + r"\s*\}")
HEAD_CAP = 1024  # a call head longer than this is not a call head


@dataclass(frozen=True, slots=True)
class JsonTagsFormat:
    name: str
    starts: tuple[str, ...]  # top-level markers that open a section (or a call, when call_start is None)
    section_end: str | None = None  # e.g. <|tool_calls_section_end|>; None: the section is one call
    call_start: str | None = None  # call marker inside a section
    call_end: str | None = None  # None: the call ends when its JSON closes
    # the call end marker may be missing: whatever else follows the call is text (GigaChat's end-of-sequence token,
    # which shows only with special tokens on)
    optional_call_end: bool = False
    head_end: str | None = None  # None: JSON wrapper {"name", "arguments"}; else the marker ending a name head
    name_of: Callable[[str], tuple[str, str | None] | None] | None = None  # head text -> (name, model id)
    list_sep: str | None = None  # llama3_json: wrappers separated by ';'
    # [TOOL_CALLS] followed by either a JSON list of wrappers or NAME[ARGS]{..} (Phi-4-mini: `functools` and the list)
    mistral_list: bool = False
    json_list: bool = False  # the section is one JSON list of wrappers (`[` must follow the start marker)
    # (start marker, the marker closing its list) where a start marker has its own close (xLAM: <tool_call> ->
    # </tool_call>, ```json -> ```); other markers close with `section_end`
    closes: tuple[tuple[str, str], ...] = ()
    bare_start: str | None = None  # a call may also open the text with this character, without a marker
    head_grammar: str | None = None  # regex the whole name head must match; checked as a prefix while it grows
    args_end_head: bool = False  # the `{` opening the arguments also ends the head (Mistral v11: NAME{...})
    # start (or call) markers that are the call's own first text (llama3: `{"name"`; MiniMax-M1: each `{` of
    # its one-wrapper-per-line section)
    inline_starts: tuple[str, ...] = ()
    name_only_call: bool = True  # `{"name": "F"}` without arguments is a call (llama3_json: it is not)
    special_tokens: bool = False
    # the family's think block, inside which no call is looked for (MiniMax-M1, Hunyuan: they reason about calls
    # there; without a reasoning parser the block stays text)
    think: tuple[str, str] | None = None
    harmony: ClassVar[bool] = False  # not a whole-stream format (see formats.HarmonyFormat)

    def engine(self, schemas) -> JsonTagsEngine:
        """The per-request engine for this format (the format declares it, `stream.py` just asks)."""
        return JsonTagsEngine(self)


(SEC, WRAP_HEAD, NAME_HEAD, ARG_WAIT, ARGS, ARGS_BUF, WRAP_TAIL, WRAP_TAIL_NAME, CALL_TAIL, AFTER_CALL,
 LIST_OPEN, SKIP, LIST_SEEK) = range(13)
# states in which a call has begun but not completed: at the end of the stream its raw text is released
_OPEN_CALL = frozenset({WRAP_HEAD, NAME_HEAD, ARG_WAIT, ARGS, ARGS_BUF, WRAP_TAIL, WRAP_TAIL_NAME, LIST_OPEN,
                        LIST_SEEK})
_LIST_START = re.compile(r"\[\s*\{")
OVER = -1  # the section is finished


def _tail_scanner() -> JsonScanner:
    """A scanner positioned just after the arguments value inside the wrapper object."""
    s = JsonScanner()
    s.stack.append("{")
    s.state = AFTER
    return s


class JsonTagsEngine(SectionEngine):
    OVER = OVER

    def __init__(self, fmt: JsonTagsFormat):
        self.fmt = fmt
        self.sec_m = Matcher([m for m in (fmt.call_start, fmt.section_end) if m])
        self.end_m = self._end_m = Matcher([m for m in (fmt.call_end, fmt.section_end) if m])
        self.head_m = Matcher(([fmt.head_end] if fmt.head_end else []) + (["{"] if fmt.args_end_head else []))
        self.head_re = regex.compile(fmt.head_grammar) if fmt.head_grammar else None
        self.section_end = fmt.section_end
        self.closes = {start: (end, Matcher([end])) for start, end in fmt.closes}
        self.state = SEC
        self.degraded = False
        self.steps = (self.step_section, self._step_wrap_head, self._step_name_head, self._step_arg_wait,
                      self._step_args, self._step_args_buf, self._step_wrap_tail, self._step_wrap_tail_name,
                      self._step_call_tail, self._step_after_call, self._step_list_open, self._step_skip,
                      self._step_list_seek)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def open(self, marker: str) -> None:
        f = self.fmt
        self.degraded = False
        self.raw: list[str] = [marker]  # this call's consumed text, released as text if it turns out malformed
        self.mark_idx = 0  # where in `raw` the marker that opened the current call is
        self.hold = ""
        self.in_list = False
        self.sought = False
        if self.closes:
            self.section_end, self.end_m = self.closes.get(marker, (f.section_end, self._end_m))
        self._reset_call()
        # an inline start marker is the beginning of the wrapper itself: the head is matched as marker + text
        self.head_prefix = marker if marker in f.inline_starts else ""
        if f.mistral_list or f.json_list:
            self.state = LIST_OPEN
        elif f.call_start:
            self.state = SEC
        else:
            self._begin_head()

    def eof(self, sink: Sink) -> None:
        """End of stream: an open call is abandoned, never guessed (its streamed prefix has no ToolCallEnd); the text
        it consumed is released as text so the non-streaming answer loses nothing."""
        rest = "".join(self.raw) + self.head + self.hold
        if self.state in _OPEN_CALL or (self.state == SEC and rest.strip()) or (
                self.state == CALL_TAIL and self.fmt.optional_call_end):  # (what may have begun an end marker)
            sink.plain(rest)
        self.raw, self.head, self.hold = [], "", ""

    # -- helpers ----------------------------------------------------------------------------------------------
    def _reset_call(self) -> None:
        self.head = ""
        self.idx = -1
        self.name = ""
        self.model_id = None
        self.scan: JsonScanner | None = None
        self.argbuf: list[str] = []
        self.wrapped = False

    def _begin_head(self) -> None:
        self.wrapped = self.fmt.head_end is None or self.in_list
        self.state = WRAP_HEAD if self.wrapped else NAME_HEAD

    def _fail(self, sink: Sink, rest: str) -> str | None:
        """A malformed call. Inside a section of several calls it is skipped (abandoned) up to its end marker and
        the section goes on; otherwise the markup degrades to text."""
        if self.fmt.call_start and self.fmt.call_end and self.mark_idx >= 0 and self.raw[self.mark_idx] == \
                self.fmt.call_start:
            # the end marker is looked for from the call marker on, not from where the error showed: that point
            # depends on how the deltas were split
            rest = "".join(self.raw[self.mark_idx + 1:]) + rest
            self.raw, self.mark_idx = [], -1
            self._reset_call()
            self.state = SKIP
            return self.feed(rest, sink)
        if self.fmt.mistral_list and not self.sought and self.mark_idx == 0 and len(self.raw) <= 2:
            # the first call after [TOOL_CALLS] is neither a list nor NAME[ARGS]: pre-v11 output may carry a little
            # noise before its list (vLLM searches for the list), so look for one close by before giving up
            self.sought, self.state = True, LIST_SEEK
            self.head = ""
            return rest, 0
        return self.degrade(sink, rest)

    def _finished_call(self) -> int:
        """State after a complete call."""
        self.raw = []
        self.mark_idx = -1
        self._reset_call()
        f = self.fmt
        if f.call_end:
            return CALL_TAIL
        if f.list_sep or self.in_list:
            return AFTER_CALL
        # calls without an end marker inside a section (MiniMax-M1's lines): the next call or the section end
        return SEC if f.section_end else OVER

    # -- one step per state (the loop is SectionEngine.feed) -----------------------------------------------------
    def call_marker(self, mk: str) -> None:
        self.mark_idx = len(self.raw)
        self.raw.append(mk)
        self._begin_head()
        if mk in self.fmt.inline_starts:
            self.head_prefix = mk

    def _head_done(self, end: int):
        """The head (buffered in `head`) ends at `end`: the arguments come next."""
        self.raw.append(self.head[:end])
        rest = self.head[end:]
        self.head = ""
        self.state = ARG_WAIT
        return rest, 0

    def _step_wrap_head(self, t: str, i: int, sink: Sink):
        """`{"name": "F", "arguments": ` (or the arguments first), matched as a whole on the buffered head."""
        self.head += t[i:] if i else t
        hp = self.head_prefix
        m = _WRAP_HEAD.match(hp + self.head, partial=True)
        if m is None or (len(self.head) > HEAD_CAP and (m.partial or m.end() > HEAD_CAP)):
            return self._fail(sink, self.head)
        if m.partial:
            return None
        end = m.end() - len(hp)
        self.head_prefix = ""
        if m.group("argsfirst") is not None:
            self.name = ""
        else:
            try:
                self.name = json.loads('"' + m.group(1) + '"')
            except ValueError:
                return self._fail(sink, self.head)
        if not m.group(2):
            return self._head_done(end)
        # {"name": "F"}: a call without arguments
        self.raw.append(self.head[:end])
        rest = self.head[end:]
        if not self.fmt.name_only_call:
            return self._fail(sink, rest)
        idx = sink.start(self.name)
        sink.args(idx, "{}")
        sink.end(idx)
        self.state = self._finished_call()
        return rest, 0

    def _step_name_head(self, t: str, i: int, sink: Sink):
        """A name head ended by `head_end` (or by the `{` of the arguments), checked against `head_grammar`."""
        f = self.fmt
        old = len(self.head)
        self.head += t[i:] if i else t
        p, mk = self.head_m.search(self.head, max(0, old - len(f.head_end) + 1))
        if p > HEAD_CAP:
            p = -1
        if p < 0:
            if len(self.head) > HEAD_CAP or (self.head_re and not self.head_re.fullmatch(
                    self.head, 0, self.head_m.hold_start(self.head), partial=True)):
                return self._fail(sink, self.head)
            return None
        end = p if mk == "{" else p + len(mk)  # a `{` ending the head opens the arguments
        ok = self.head_re is None or self.head_re.fullmatch(self.head, 0, p)
        parsed = ok and (f.name_of(self.head[:p]) if f.name_of else (self.head[:p].strip(), None))
        if not parsed or not parsed[0]:
            return self._fail(sink, self.head)
        self.name, self.model_id = parsed
        return self._head_done(end)

    def _step_arg_wait(self, t: str, i: int, sink: Sink):
        """Whitespace, then the arguments: an object streams; a wrapper's string or args-before-name is buffered."""
        j = _WS.match(t, i).end()
        self.raw.append(t[i:j])
        if j >= len(t):
            return None
        c = t[j]
        if c == "{" and self.name:
            self.idx = sink.start(self.name, self.model_id)
            self.scan = JsonScanner()
            self.state = ARGS
        elif c in '{"' and self.wrapped:  # arguments before the name, or arguments as a JSON string
            self.scan = JsonScanner()
            self.argbuf = []
            self.state = ARGS_BUF
        else:
            return self._fail(sink, t[j:])
        return t, j

    def _step_args(self, t: str, i: int, sink: Sink):
        """The arguments object streams raw while the scanner finds where it closes."""
        r = self.scan.feed(t, i)
        if r == ERROR:  # the streamed prefix stays without an End: the call is abandoned
            return self._fail(sink, t[i:])
        seg = t[i:] if r == NEED_MORE else t[i:r]
        sink.args(self.idx, seg)
        self.raw.append(seg)
        if r == NEED_MORE:
            return None
        if self.wrapped:
            self.scan, self.tail = _tail_scanner(), ""
            self.state = WRAP_TAIL
        else:
            sink.end(self.idx)
            self.state = self._finished_call()
        return t, r

    def _step_args_buf(self, t: str, i: int, sink: Sink):
        """Buffered arguments (a JSON string, or before the name); emitted once complete."""
        r = self.scan.feed(t, i)
        if r == ERROR:
            return self._fail(sink, t[i:])
        seg = t[i:] if r == NEED_MORE else t[i:r]
        self.argbuf.append(seg)
        self.raw.append(seg)
        if r == NEED_MORE:
            return None
        args = "".join(self.argbuf)
        if args.startswith('"'):  # arguments given as a JSON-encoded string
            try:
                inner = json.loads(args)
                ok = isinstance(json.loads(inner), dict)
            except (ValueError, TypeError):
                ok = False
            if not ok:
                return self._fail(sink, t[r:])
            self.argbuf = [inner]
        if self.name:
            self.idx = sink.start(self.name, self.model_id)
            sink.args(self.idx, "".join(self.argbuf))
            self.scan, self.tail = _tail_scanner(), ""
            self.state = WRAP_TAIL
        else:
            self.head = ""
            self.state = WRAP_TAIL_NAME
        return t, r

    def _step_wrap_tail(self, t: str, i: int, sink: Sink):
        """After the arguments inside the wrapper: its closing `}`."""
        r = self.scan.feed(t, i)
        if r == NEED_MORE:
            self.raw.append(t[i:])
            self.tail += t[i:]  # whitespace so far: given back if the wrapper turns out not to close
            return None
        if r != ERROR:
            i = r
        else:
            t, i = self.tail + t[i:], 0
        # complete, valid arguments: the call stands even if junk follows inside the wrapper
        sink.end(self.idx)
        self.state = self._finished_call()
        if r == ERROR and self.state != CALL_TAIL:
            self.state = OVER
        return t, i

    def _step_wrap_tail_name(self, t: str, i: int, sink: Sink):
        """`, "name": "F"}` after arguments that came first."""
        self.head += t[i:]
        m = _WRAP_TAIL_NAME.match(self.head, partial=True)
        if m is None or (len(self.head) > HEAD_CAP and (m.partial or m.end() > HEAD_CAP)):
            return self._fail(sink, self.head)
        if m.partial:
            return None
        try:
            self.name = json.loads('"' + m.group(1) + '"')
        except ValueError:
            return self._fail(sink, self.head)
        rest = self.head[m.end():]
        idx = sink.start(self.name)
        sink.args(idx, "".join(self.argbuf))
        sink.end(idx)
        self.state = self._finished_call()
        return rest, 0

    def _step_skip(self, t: str, i: int, sink: Sink):
        """A malformed call inside a section: everything up to its end marker is dropped."""
        p, mk = self.find(self.end_m, t, i)
        if p < 0:
            return None
        self.state = OVER if mk == self.fmt.section_end else SEC
        return t, p + len(mk)

    def _step_call_tail(self, t: str, i: int, sink: Sink):
        """After a call's arguments: its end marker (or the section's)."""
        f = self.fmt
        if f.optional_call_end:  # right after the call, or not at all
            if len(t) - i < len(f.call_end) and f.call_end.startswith(t[i:]):
                self.hold = t[i:]  # the end marker may be arriving
                return None
            if not t.startswith(f.call_end, i):  # not there: the call is over, what follows is text
                self.state = OVER
                return t, i
        p, mk = self.find(self.end_m, t, i)
        if p < 0:
            return None
        if mk == self.section_end or not self.section_end:
            self.state = AFTER_CALL if f.list_sep else OVER
        else:
            self.state = SEC
        return t, p + len(mk)

    def _step_after_call(self, t: str, i: int, sink: Sink):
        """Between calls of a list (llama3's `;`, a JSON list's `,`): another call, or the end."""
        j = _WS.match(t, i).end()
        if j >= len(t):
            self.hold = t[i:]
            return None
        c = t[j]
        if (c == self.fmt.list_sep and not self.in_list) or (c == "," and self.in_list):
            i = j + 1
            self.raw = [t[j]]
            self.mark_idx = 0
            self._begin_head()
        elif self.in_list and c == "]":
            i = j + 1
            # a list inside tags (Hunyuan, Jamba): what follows up to the section end is not content
            self.state = CALL_TAIL if self.section_end else OVER
        else:
            self.state = OVER
        return t, i

    def _step_list_seek(self, t: str, i: int, sink: Sink):
        """Noise after [TOOL_CALLS]: a `[{` list within NOISE_CAP characters is the calls, the noise is dropped
        (released as text only if the list degrades); none there: the markup was text."""
        self.head += t[i:] if i else t
        m = _LIST_START.search(self.head, 0, NOISE_CAP + 2)
        if m is None:
            if len(self.head) > NOISE_CAP + 2:
                return self.degrade(sink, self.head)
            return None
        rest, noise = self.head[m.start():], self.head[:m.start()]
        self.raw.append(noise)
        self.head = ""
        self.state = LIST_OPEN
        return rest, 0

    def _step_list_open(self, t: str, i: int, sink: Sink):
        """`[` opens a JSON list of wrappers; anything else is one call in Mistral's v11 form, or (json_list) not
        a call."""
        j = _WS.match(t, i).end()
        if j >= len(t):
            self.hold = t[i:]
            return None
        if t[j] == "[":
            self.in_list = True
            self.raw.append(t[i:j + 1])
            j += 1
        elif self.fmt.json_list:  # only a list is a call here
            return self._fail(sink, t[i:])
        else:  # the whitespace is part of the call's text: given back with it if the call degrades
            self.raw.append(t[i:j])
        self._begin_head()
        return t, j
