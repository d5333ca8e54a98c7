"""What the tag engines (json_tags, xml_tags, xml_elements) share: the section loop (one small step method per
state), finding the next call marker inside a tool-call section, giving up on markup that turns out not to be a
call, and (FedSectionEngine) giving an abandoned call back as the text the model wrote."""

from __future__ import annotations

from serve_app.parsers.markers import Matcher
from serve_app.parsers.sink import Sink

HELD = object()  # `seek_marker`: the text ends inside what may be a marker; wait for more
NOISE_CAP = 256  # text inside a section before the next call marker: skipped when a call marker follows within this


class SectionEngine:
    """Subclasses set `sec_m` (a Matcher over the call and section-end markers) and `steps` (one step method per
    state, indexed by the state's number; the state numbered SEC is `step_section`), and keep, per call, `raw` (the
    text consumed so far, released as text if the call proves malformed), `mark_idx` (where in `raw` the marker
    that must become text sits), `hold` (a possible partial marker), `state`, `degraded`, and an OVER state."""

    sec_m: Matcher
    section_end: str | None
    OVER: int
    steps: tuple
    # keep every fed text in `call_raw` (xml_tags: what `eof` releases); a flag in this loop, not an overriding
    # feed, because that extra call per token is measurable
    tracks_fed = False

    def feed(self, text: str, sink: Sink) -> str | None:
        """Consume `text`; None while still inside the section, else the text after it (maybe empty).

        Each step consumes from `t[i:]` in one state and returns where to go on, `(t, i)` (the state it set may
        differ), or what `feed` returns: None (wait for more text) or the text after the section."""
        if self.tracks_fed:
            self.call_raw.append(text)
        t = self.hold + text if self.hold else text
        self.hold = ""
        i = 0
        over = self.OVER
        steps = self.steps
        while True:
            st = self.state
            if st == over:
                return t[i:]
            if i >= len(t):
                return None
            r = steps[st](t, i, sink)
            if r.__class__ is not tuple:
                return r
            t, i = r

    def step_section(self, t: str, i: int, sink: Sink):
        """Between calls: the next call marker opens a call (`call_marker`), the section end ends the section."""
        found = self.seek_marker(t, i, sink)
        if found is HELD:
            return None
        if found.__class__ is str:
            return found
        mk, i = found
        if mk == self.section_end:
            self.state = self.OVER
        else:
            self.call_marker(mk)
        return t, i

    def call_marker(self, mk: str) -> None:
        """A call marker was found between calls: record it and go on to the call's head."""
        raise NotImplementedError

    def find(self, m: Matcher, t: str, i: int) -> tuple[int, str]:
        """`m.search`, keeping a possible partial marker at the end in `hold` when nothing was found."""
        p, mk = m.search(t, i)
        if p < 0:
            self.hold = t[m.hold_start(t, i):]
        return p, mk

    def seek_marker(self, t: str, i: int, sink: Sink) -> tuple[str, int] | str | object:
        """Between calls only whitespace is expected before the next marker. Returns (marker, index after it);
        HELD when the text ends inside a possible marker (kept in `hold`); or, when something else stands there
        and no call marker follows it closely, the text to rescan as plain text (the engine has degraded).
        A little noise before a call marker (vLLM drops it too) is skipped, so the calls after it still count."""
        p, mk = self.sec_m.search(t, i)
        stop = p if p >= 0 else self.sec_m.hold_start(t, i)
        if t[i:stop].strip():
            if p >= 0 and mk != self.section_end and p - i <= NOISE_CAP:
                self.raw.append(t[i:p])  # noise: not shown, unless the call after it degrades
                return mk, p + len(mk)
            if p < 0 and stop - i <= NOISE_CAP:  # a call marker may still follow: wait (bounded)
                self.hold = t[i:]
                return HELD
            return self.degrade(sink, t[i:])  # not a call where one must be: the markup was text, rescanned
        self.raw.append(t[i:stop])
        if p < 0:
            self.hold = t[stop:]
            return HELD
        return mk, p + len(mk)

    def degrade(self, sink: Sink, rest: str) -> str:
        """Not a call: the marker that opened it becomes text and everything after it is scanned again as
        top-level text, so the outcome does not depend on where the deltas were split."""
        k = self.mark_idx + 1
        sink.plain("".join(self.raw[:k]))
        rest = "".join(self.raw[k:]) + rest
        self.raw = []
        self.degraded = True
        self.state = self.OVER
        return rest


class FedSectionEngine(SectionEngine):
    """A section engine that keeps every text fed since the last completed call (`call_raw`), so that a call it
    abandons, or one the end of the stream cuts off, goes back as the text the model wrote (xml_tags, xml_elements).
    Subclasses start `call_raw` with the section marker in `open`."""

    tracks_fed = True
    call_raw: list[str]

    def take_fed(self, unconsumed: int) -> str:
        """The text fed since the last completed call but its last `unconsumed` characters, which stay fed (they
        follow what was consumed)."""
        fed = "".join(self.call_raw)
        self.call_raw = [fed[len(fed) - unconsumed:]] if unconsumed else []
        return fed[:len(fed) - unconsumed]

    def eof(self, sink: Sink) -> None:
        """A call or value cut off by the end of the stream is abandoned: no ToolCallEnd, nothing guessed. Its text
        (from the section or call marker on) is released as text; a separator after a finished call is not."""
        rest = "".join(self.call_raw)
        if self.state != self.OVER and rest.strip():
            sink.plain(rest)
        self.call_raw = []
