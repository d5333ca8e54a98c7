"""Where engines put their events: one per request, it owns call indexes and ids."""

from __future__ import annotations

import os

from serve_app.conversation import ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart


def new_call_id() -> str:
    return "call_" + os.urandom(12).hex()


class Sink:
    """Collects the events of one push. `reasoning` says which kind plain text currently is (a call's markup that
    degrades to text inside a think block stays reasoning)."""

    __slots__ = ("out", "reasoning", "next_index", "_ids")

    def __init__(self) -> None:
        self.out: list = []
        self.reasoning = False
        self.next_index = 0
        self._ids: set[str] = set()

    def plain(self, text: str) -> None:
        if text:
            self.out.append(ReasoningDelta(text) if self.reasoning else TextDelta(text))

    def start(self, name: str, model_id: str | None = None) -> int:
        """Open a call. A model-generated id (Kimi's `functions.NAME:IDX`, which its template renders back) is
        kept when it is unique in this request, so the next turn's prompt reproduces the generated tokens."""
        idx = self.next_index
        self.next_index += 1
        cid = model_id if model_id and model_id not in self._ids else new_call_id()
        self._ids.add(cid)
        self.out.append(ToolCallStart(idx, cid, name))
        return idx

    def args(self, idx: int, text: str) -> None:
        if text:
            self.out.append(ToolCallArgsDelta(idx, text))

    def end(self, idx: int) -> None:
        self.out.append(ToolCallEnd(idx))
