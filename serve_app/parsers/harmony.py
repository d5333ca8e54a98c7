"""gpt-oss Harmony channels: one engine for both the `gpt_oss` reasoning parser and the `openai` tool parser.

    <|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>{…}<|call|>  …  <|start|>assistant<|channel|>final<|message|>…<|return|>

analysis → reasoning, final (and commentary without a recipient: preambles) → text, a `to=functions.NAME`
recipient → a tool call whose arguments stream raw under a JsonScanner (same rules as the JSON-in-tags engine).
The recipient may sit in the header before or after the channel. The generation prompt ends with
`<|start|>assistant`, so output that opens like a header (`to=…` or `<|channel|>`) is the first message's header;
anything else is text, and a header cut off by the end comes back as text. Text messages are concatenated as streamed. A
call with an empty body is a call without arguments (`{}`); one whose body is not a JSON object is abandoned (a
ToolCallStart without End) and skipped to its message end — its markup never becomes text. A message to any other
recipient (`to=assistant`, a built-in tool) is not content and is skipped.
"""

from __future__ import annotations

import re

from serve_app.parsers.jsonscan import ERROR, NEED_MORE, JsonScanner
from serve_app.parsers.markers import Matcher
from serve_app.parsers.sink import Sink

START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN = (
    "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w.-]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_WS = re.compile(r"\s*")
HEADER_CAP = 512
_BUILTINS = frozenset({"browser", "python", "container"})  # gpt-oss built-in tools: not function calls

BODY, HEADER, ARGS_WAIT, ARGS, DROP, OPENING = range(6)
# The generation prompt ends with `<|start|>assistant`, so the model's first message may go straight on with the
# rest of its header: ` to=functions.NAME<|channel|>commentary json<|message|>…` or `<|channel|>analysis…`.
_HEADER_OPENINGS = ("to=", CHANNEL)


class HarmonyParser:
    """Same interface as the composite parser: push(delta) -> events, finish() -> events."""

    def __init__(self, want_reasoning: bool = True, want_tools: bool = True):
        self.want_reasoning = want_reasoning
        self.want_tools = want_tools
        self.sink = Sink()
        self.body_m = Matcher(MARKERS)
        self.hdr_m = Matcher([MESSAGE])
        self.state = OPENING
        self.kind = "text"
        self.hold = ""
        self.head = ""
        self.name = ""
        self.idx = -1
        self.scan: JsonScanner | None = None
        # consecutive messages of one kind (a preamble, then the final answer) are joined with a newline, as vLLM's
        # non-streaming Harmony path joins them; not across a call, where they stay separate parts that the
        # template replays as separate messages. Per kind: has one been shown, does the next need the separator
        self.shown = {"text": False, "reasoning": False}
        self.sep = {"text": False, "reasoning": False}
        # one step per state, indexed by state: BODY, HEADER, ARGS_WAIT, ARGS, DROP, OPENING
        self.steps = (self._step_body, self._step_header, self._step_args_wait, self._step_args, self._step_body,
                      self._step_opening)

    def _plain(self, text: str, kind: str) -> None:
        if not text:
            return
        if self.sep[kind]:
            text, self.sep[kind] = "\n" + text, False
        self.shown[kind] = True
        self.sink.reasoning = kind == "reasoning"
        self.sink.plain(text)

    def _open_body(self, header: str) -> None:
        ch = _CHANNEL.search(header)
        channel = ch.group(1) if ch else ""
        rcp = _RECIPIENT.search(header)
        recipient = rcp.group(1) if rcp else ""
        if recipient and self.want_tools:
            if recipient == "assistant" or (not recipient.startswith("functions.") and "." in recipient
                                            and recipient.split(".", 1)[0] in _BUILTINS):
                self.state = DROP  # addressed to someone else: not content, not a function call
                return
            self.name = recipient.removeprefix("functions.")
            self.state = ARGS_WAIT
            self.shown = {"text": False, "reasoning": False}  # a call between two messages: they stay apart
            return
        self.state = BODY
        if channel == "analysis":
            self.kind = "reasoning" if self.want_reasoning else "text"
        else:
            self.kind = "text"
        self.sep[self.kind] = self.shown[self.kind]

    def push(self, delta: str, token_ids=None) -> list:
        out = self.sink.out = []
        t = self.hold + delta if self.hold else delta
        self.hold = ""
        i = 0
        steps = self.steps
        # each step consumes from t[i:] in one state and returns where to go on, or None when it needs more text
        while i < len(t):
            r = steps[self.state](t, i)
            if r is None:
                break
            t, i = r
        return out

    def _step_opening(self, t: str, i: int):
        """The first message's header, unless the output starts as plain text."""
        j = _WS.match(t, i).end()
        rest = t[j:]
        if any(o.startswith(rest) for o in _HEADER_OPENINGS):  # too short to tell: hold it back
            self.hold = t[i:]
            return None
        if rest.startswith(_HEADER_OPENINGS):
            self.state, self.head = HEADER, ""  # its leading whitespace stays in the header
        else:
            self.state = BODY
        return t, i

    def _step_body(self, t: str, i: int):
        """A message body up to the next marker: shown (BODY) or skipped (DROP)."""
        show = self.state == BODY
        p, mk = self.body_m.search(t, i)
        if p < 0:
            h = self.body_m.hold_start(t, i)
            if show:
                self._plain(t[i:h], self.kind)
            self.hold = t[h:]
            return None
        if show:
            self._plain(t[i:p], self.kind)
        if mk in (START, CHANNEL):
            self.state, self.head = HEADER, mk
        else:  # a message end (or a stray token): the next text, if any, is plain text
            self.state, self.kind = BODY, "text"
        return t, p + len(mk)

    def _step_header(self, t: str, i: int):
        """A header up to `<|message|>`: it says what the body is (`_open_body`)."""
        old = len(self.head)
        self.head += t[i:]
        p, mk = self.hdr_m.search(self.head, max(0, old - len(MESSAGE)))
        if p > HEADER_CAP or (p < 0 and len(self.head) > HEADER_CAP + len(MESSAGE)):
            # not a header: show its start as text and rescan the rest (the same wherever deltas split)
            self._plain(self.head[:HEADER_CAP], "text")
            rest = self.head[HEADER_CAP:]
            self.head = ""
            self.state, self.kind = BODY, "text"
            return rest, 0
        if p < 0:
            return None
        rest = self.head[p + len(mk):]
        self._open_body(self.head[:p])
        self.head = ""
        return rest, 0

    def _step_args_wait(self, t: str, i: int):
        """A call's body: a JSON object streams, an empty body is `{}`, anything else abandons the call."""
        j = _WS.match(t, i).end()
        if j >= len(t):
            return None
        if t[j] == "{":
            self.idx = self.sink.start(self.name)
            self.scan = JsonScanner()
            self.state = ARGS
            return t, j
        p, mk = self.body_m.search(t, j)
        if p == j:  # the message ends with an empty body: a call without arguments
            idx = self.sink.start(self.name)
            self.sink.args(idx, "{}")
            self.sink.end(idx)
            self.state = DROP
            return t, j
        if p < 0 and self.body_m.hold_start(t, j) == j:  # maybe the start of the message end marker
            self.hold = t[j:]
            return None
        self.sink.start(self.name)  # not a JSON object: abandoned (no End), its body skipped
        self.state = DROP
        return t, j

    def _step_args(self, t: str, i: int):
        """The arguments object streams raw while the scanner finds where it closes."""
        p, mk = self.body_m.search(t, i)  # special tokens cannot occur inside the JSON text
        stop = p if p >= 0 else self.body_m.hold_start(t, i)
        r = self.scan.feed(t[:stop], i)
        if r == ERROR:  # abandoned (no ToolCallEnd): the rest of its message is skipped
            self.state = DROP
            return t, i
        seg = t[i:stop] if r == NEED_MORE else t[i:r]
        self.sink.args(self.idx, seg)
        if r == NEED_MORE:
            if p < 0:
                self.hold = t[stop:]
                return None
            # the message ended before the arguments closed: cut off, abandoned
            self.state = DROP
            return t, stop
        self.sink.end(self.idx)
        self.state = DROP  # whatever follows up to <|call|> is not content
        return t, r

    def finish(self) -> list:
        out = self.sink.out = []
        if self.state in (BODY, OPENING) and self.hold:
            self._plain(self.hold, self.kind)
        elif self.state == HEADER and self.head:  # a header the end cut off: never guessed, never lost
            self._plain(self.head, "text")
            self.head = ""
        self.hold = ""
        return out
