"""A non-empty answer on request: vLLM's `force_nonempty_content`.

A turn that ends with reasoning and nothing else (no text that is not whitespace, no finished call) gives an
agent an empty message: the model never closed its think block, or wrote one itself with thinking off. Harnesses
ask for the reasoning as the answer then: OpenClaw's bundled vLLM plugin sends `chat_template_kwargs:
{"enable_thinking": false, "force_nonempty_content": true}` for Nemotron 3 with thinking off, and vLLM's nemotron_v3
parser does the same whenever thinking is off. Here the request's `force_nonempty_content` works for every
reasoning format; thinking off does it for the formats whose row says so (`ReasoningFormat.answer_when_thinking_off`).
"""

from __future__ import annotations

from typing import Any

from serve_app.conversation import AnswerFromReasoning, ReasoningDelta, TextDelta, ToolCallEnd
from serve_app.parsers.formats import REASONING_PARSERS


def understood_kwargs(reasoning: str | None) -> dict[str, str]:
    """The chat_template_kwargs this module reads for a reasoning format (kwarg → what it does): what
    `families --json` lists as a family's `parser_kwargs`."""
    if not reasoning:
        return {}
    what = "bool: a turn that ends with only reasoning gives it again as the answer (vLLM's option)"
    if REASONING_PARSERS[reasoning].answer_when_thinking_off:
        what += "; thinking off does this without it"
    return {"force_nonempty_content": what}


def answer_required(reasoning: str | None, chat_template_kwargs: dict[str, Any] | None,
                    thinking: bool | None) -> bool:
    """Whether a turn that is only reasoning gives it again as its answer (`thinking`: the request's thinking
    switch, None when it set none)."""
    if not reasoning:
        return False
    kwargs = chat_template_kwargs or {}
    if kwargs.get("force_nonempty_content") is True:
        return True
    off = thinking is False or kwargs.get("enable_thinking") is False
    return off and REASONING_PARSERS[reasoning].answer_when_thinking_off


class AnswerRequired:
    """Wraps one request's parser (same push/finish contract): watches what it emits and, at the end, when there
    was reasoning and no answer, adds `AnswerFromReasoning` with the whole reasoning. Split-invariant because the
    wrapped parser is: the decision is made on the folded events, at `finish`."""

    def __init__(self, parser):
        self.parser = parser
        self.reasoning: list[str] | None = []  # None once the turn has an answer: nothing more to keep

    def _see(self, events: list) -> list:
        if self.reasoning is not None:
            for ev in events:
                if isinstance(ev, ReasoningDelta):
                    self.reasoning.append(ev.text)
                elif isinstance(ev, ToolCallEnd) or (isinstance(ev, TextDelta) and ev.text.strip()):
                    self.reasoning = None
                    break
        return events

    def push(self, delta: str, token_ids=None) -> list:
        return self._see(self.parser.push(delta, token_ids))

    def finish(self) -> list:
        events = self._see(self.parser.finish())
        text = "".join(self.reasoning) if self.reasoning is not None else ""
        if text:
            events.append(AnswerFromReasoning(text))
        return events
