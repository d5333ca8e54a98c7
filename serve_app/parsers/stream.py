"""The per-request parser the ingress runs: think-tag reasoning split and tool-call parsing in one pass.

One scanner looks for the reasoning markers and the tool format's start markers together, so a tool call that
starts inside a think block (Qwen3.5, vllm#39056) is still a tool call and order is kept:
think → call → think → call → text. Inside a tool section the format's engine consumes text until the section
ends and hands the rest back. Outside, only a marker-sized suffix is ever held back.

Event contract beyond the IR: a ToolCallStart that is never followed by its ToolCallEnd is an abandoned call (cut
off by the end of the stream, or malformed after it started streaming); `fold_complete` drops such calls, and
streaming encoders should treat them as truncated.
"""

from __future__ import annotations

import re

from serve_app.conversation import complete_answer, fold_events
from serve_app.parsers.answer import AnswerRequired
from serve_app.parsers.formats import REASONING_PARSERS, TOOL_PARSERS, ReasoningFormat
from serve_app.parsers.harmony import HarmonyParser
from serve_app.parsers.markers import Matcher
from serve_app.parsers.schema import ToolSchemas
from serve_app.parsers.sink import Sink

_WS = re.compile(r"\s*")


class StreamParser:
    def __init__(self, reasoning: ReasoningFormat | None, tools, tool_schemas: list[dict] | None,
                 starts_in_reasoning: bool | None):
        self.sink = Sink()
        self.prefix = ""
        if reasoning is not None and reasoning.as_content:
            # the client parses the think block: no reasoning split, and a start marker the prompt opened is put
            # back in front of the output (with the first text the model writes)
            opened = reasoning.starts_in_reasoning if starts_in_reasoning is None else starts_in_reasoning
            self.prefix = reasoning.start if opened else ""
            reasoning = None
        self.r = reasoning
        self.engine = tools.engine(ToolSchemas(tool_schemas)) if tools is not None else None
        starts = tuple(getattr(tools, "starts", ())) if tools is not None else ()
        self.bare = getattr(tools, "bare_start", None) if tools is not None else None
        if starts_in_reasoning is None:
            starts_in_reasoning = bool(reasoning and reasoning.starts_in_reasoning)
        self.in_reasoning = bool(reasoning) and starts_in_reasoning
        self.starts = (reasoning.start, *reasoning.start_alts) if reasoning else ()
        self.ends = (reasoning.end, *reasoning.end_alts) if reasoning else ()
        # the answer's markup tags: the reasoning format's, and the tool format's own (Kimi K3's tool parser alone
        # still unwraps the response channel, as vLLM's does)
        self.answer = tuple(dict.fromkeys((*(reasoning.answer or () if reasoning else ()),
                                           *getattr(tools, "markup", ()))))
        self.ends_at = reasoning.ends_at if reasoning is not None and tools is None else ()
        # a tool format that looks for no calls inside its family's think block: without a reasoning parser that
        # block is tracked here (and stays text); with one, reasoning is that block
        self.opaque = getattr(tools, "think", None) if tools is not None else None
        self.in_opaque = False
        own = self.opaque if self.opaque and reasoning is None else ()
        # a stray end marker in text and a repeated start marker in reasoning are markup: matched and dropped
        self.m = Matcher((*self.starts, *self.ends, *self.answer, *starts, *self.ends_at, *own))
        self.active = False
        # whitespace-only text right after a tool call is the model's separator between calls: it is kept back
        # and dropped unless real text follows (then it is released verbatim)
        self.after_call = False
        self.pending_ws = ""
        self.entered_in_reasoning = False
        self.text_started = False
        self.hold = ""
        # whitespace that opens the output is held until we know what follows: dropped before a tool call or a
        # repeated think start marker (vLLM reports no content there), given back before anything else
        self.at_start = True
        self.pending_start = ""
        # trim_end_newlines: a "\n" held until we know whether the end marker (in reasoning) or an answer tag (in
        # text) follows it, and whether the text right after one may still lose its leading "\n"
        self.trim = bool(reasoning and reasoning.trim_end_newlines)
        self.nl_held = False
        self.strip_nl = False
        # start_label: the role label that may follow the start marker, still to be seen (or not) at the head of
        # the reasoning; held while the text so far could still be it
        self.label = reasoning.start_label if reasoning is not None and self.in_reasoning else ""

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self.at_start:
            if text.isspace():
                self.pending_start += text
                return
            text, self.pending_start, self.at_start = self.pending_start + text, "", False
        if self.trim:
            text = self._trim(text)
            if not text:
                return
        self._out(text)

    def _out(self, text: str) -> None:
        if self.after_call:
            if self.in_reasoning:
                self.after_call, self.pending_ws = False, ""
            elif text.isspace():
                self.pending_ws += text
                return
            else:
                text = self.pending_ws + text
                self.after_call, self.pending_ws = False, ""
        self.sink.reasoning = self.in_reasoning
        self.sink.plain(text)
        if not self.in_reasoning and not self.in_opaque and not self.text_started and not text.isspace():
            self.text_started = True

    def _trim(self, text: str) -> str:
        if self.strip_nl:
            text, self.strip_nl = text.removeprefix("\n"), False
        if self.in_reasoning or self.answer:
            if self.nl_held:
                text, self.nl_held = "\n" + text, False
            if text.endswith("\n"):
                text, self.nl_held = text[:-1], True
        return text

    def _release_nl(self) -> None:
        """The held newline was not followed by the marker it pads: it is reasoning or text after all. Called
        before every switch between reasoning and text, so it belongs to the current one."""
        if self.nl_held:
            self.nl_held = False
            self._out("\n")

    def push(self, delta: str, token_ids=None) -> list:
        out = self.sink.out = []
        if self.prefix and delta:
            delta, self.prefix = self.prefix + delta, ""
        t = self.hold + delta if self.hold else delta
        self.hold = ""
        i = 0
        while i < len(t):
            if self.active:  # inside a tool section: the format's engine consumes it
                rest = self.engine.feed(t[i:] if i else t, self.sink)
                if rest is None:
                    return out
                self._section_over()
                t, i = rest, 0
                continue
            if self.label:
                i = self._skip_label(t, i)
                if i < 0:
                    break
                continue
            if self.bare and not self.in_reasoning and not self.text_started and not self.in_opaque:
                j = self._bare_start(t, i)
                if j is not None:
                    if j < 0:
                        break
                    t, i = t[j:], 0
                    continue
            m = self.m
            p, mk = m.search(t, i)
            if p < 0:
                h = m.hold_start(t, i)
                self._emit(t[i:h])
                self.hold = t[h:]
                break
            self._emit(t[i:p])
            i = p + len(mk)
            self._marker(mk)
        return out

    def _skip_label(self, t: str, i: int) -> int:
        """At the head of the reasoning: the role label is dropped when it is there whole (returns the index past
        it), kept as reasoning when the text turns out different (returns `i`), held (-1) while the text so far is a
        prefix of it."""
        label = self.label
        head = t[i:i + len(label)]
        if len(head) < len(label) and label.startswith(head):
            self.hold = head
            return -1
        self.label = ""
        return i + len(label) if head == label else i

    def _section_over(self) -> None:
        """The engine handed the text after its section back: a call (or degraded markup) is behind us."""
        self.active = False
        if self.engine.degraded:
            self.text_started = self.text_started or not self.in_reasoning
        else:
            self.after_call, self.pending_ws = True, ""
            r = self.r
            if self.entered_in_reasoning and r is not None and r.tool_ends_reasoning:
                self.in_reasoning = False

    def _bare_start(self, t: str, i: int) -> int | None:
        """Before any text, a call may open without a marker (`bare_start`, e.g. llama3's `{`). Returns -1 when only
        whitespace came so far (held), the index of the bare start when a call opens there (the engine is now
        active), else None (text: it starts the answer once emitted, unless it is an opaque think block)."""
        j = _WS.match(t, i).end()
        if j >= len(t):  # only whitespace so far: a bare call may still open the text
            self.hold = t[i:]
            return -1
        if t[j] == self.bare:
            self._open(t[i:j])
            return j
        return None

    def _marker(self, mk: str) -> None:
        """A think marker, an answer tag, a tool start marker, or (without a tool parser) a tool marker that ends
        reasoning."""
        r = self.r
        if mk in self.starts:
            self.pending_start, self.at_start = "", False
            self._release_nl()
            self.strip_nl = False
            self.label = r.start_label if not self.in_reasoning else ""
            self.in_reasoning = True
        elif mk in self.ends and not self.in_reasoning and not self.at_start and r.late_end_is_text:
            self._release_nl()
            self._emit(mk)  # a stray end marker after the output began is the model's text (MiniMax-M3)
        elif mk in self.ends:
            self._flush_start()
            if self.in_reasoning:
                self.strip_nl = self.trim
                self.nl_held = False  # the newline right before the end marker is not reasoning
            else:
                self._release_nl()
            self.in_reasoning = False
        elif mk in self.answer:
            if self.in_reasoning:  # only the answer is wrapped: inside the think block a tag is just text
                self._emit(mk)
            else:  # markup, with the whitespace that opens the output and (trimmed) the newline on each side
                self.pending_start, self.at_start = "", False
                self.nl_held = False
                self.strip_nl = self.trim
        elif mk in self.ends_at:  # a tool call with no tool parser: reasoning is over, the markup is text
            self._flush_start()
            self._release_nl()
            self.in_reasoning = False
            self._emit(mk)
        elif self.opaque and mk in self.opaque and r is None:
            # the block stays text but does not start the answer: a bare call may still open it (xLAM)
            self.in_opaque = True
            self._emit(mk)
            self.in_opaque = mk == self.opaque[0]
        elif self.opaque and (self.in_reasoning or self.in_opaque):  # no calls inside the think block
            self._emit(mk)
        else:
            self._open(mk)

    def _flush_start(self) -> None:
        if self.at_start:
            pending, self.pending_start, self.at_start = self.pending_start, "", False
            if pending:
                self.sink.reasoning = self.in_reasoning
                self.sink.plain(pending)

    def _open(self, marker: str) -> None:
        self._release_nl()
        self.strip_nl = False
        self.pending_start, self.at_start = "", False
        self.engine.open(marker)
        self.sink.reasoning = self.in_reasoning
        self.entered_in_reasoning = self.in_reasoning
        self.active = True

    def finish(self) -> list:
        out = self.sink.out = []
        if self.active:
            self.sink.reasoning = self.in_reasoning
            self.engine.eof(self.sink)
        elif self.hold:
            self._emit(self.hold)
        self._flush_start()
        self._release_nl()
        self.hold = ""
        self.active = False
        return out


def make_stream_parser(reasoning: str | None = None, tools: str | None = None,
                       tool_schemas: list[dict] | None = None, starts_in_reasoning: bool | None = None,
                       answer_required: bool = False):
    """One parser per request. `starts_in_reasoning`: True when the prompt ended inside the think block (e.g. the
    template appended `<think>`), False when it did not (e.g. thinking disabled), None for the format's default.
    `answer_required`: a turn that is only reasoning gives it again as its answer (parsers/answer.py).
    Unknown names raise KeyError (a misconfiguration, caught at startup by the caller)."""
    rfmt = REASONING_PARSERS[reasoning] if reasoning else None
    tfmt = TOOL_PARSERS[tools] if tools else None
    want_reasoning = rfmt is not None and rfmt.harmony
    want_tools = tfmt is not None and tfmt.harmony
    if want_reasoning or want_tools:  # Harmony's channels carry both: it parses the whole stream
        parser = HarmonyParser(want_reasoning=want_reasoning, want_tools=want_tools)
    else:
        parser = StreamParser(rfmt, tfmt, tool_schemas, starts_in_reasoning)
    return AnswerRequired(parser) if answer_required else parser


def parse_complete(text: str, reasoning: str | None = None, tools: str | None = None,
                   tool_schemas: list[dict] | None = None, starts_in_reasoning: bool | None = None,
                   answer_required: bool = False) -> list:
    """The events of a whole text: exactly what pushing it in one piece and finishing gives."""
    p = make_stream_parser(reasoning, tools, tool_schemas, starts_in_reasoning, answer_required)
    return p.push(text) + p.finish()


def fold_complete(events: list) -> list:
    """The non-streaming result: `fold_events` of `complete_answer` (no abandoned calls; a reasoning given again
    as the answer is the answer alone)."""
    return fold_events(complete_answer(events))
