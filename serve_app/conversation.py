"""The one IR every API maps into, and the semantic events every response is built from.

Request side: each protocol adapter (Anthropic Messages, Chat Completions, Responses) turns its wire request
into a `Conversation` plus `GenerationOptions`. Response side: the parsers turn engine text into the events
below, and each adapter's encoder maps those events onto its own wire format. Nothing else crosses between
adapters, so adding an API is one adapter and adding a model format is one parser.

Events are small slotted dataclasses because the parsers create one per delta on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Union

# --------------------------------------------------------------------------------------------------------------
# Conversation parts


@dataclass(slots=True)
class TextPart:
    text: str


@dataclass(slots=True)
class ReasoningPart:
    """A reasoning segment. `text` is what the model thought; `signature`/`encrypted` carry the API's
    opaque round-trip token (Anthropic signature, Responses encrypted_content) after verification."""

    text: str
    signature: str | None = None
    redacted: bool = False


@dataclass(slots=True)
class ToolCallPart:
    id: str
    name: str
    arguments: str  # the arguments JSON exactly as generated (kept byte-stable for prefix reuse)
    kind: Literal["function", "custom"] = "function"


@dataclass(slots=True)
class ToolResultPart:
    tool_call_id: str
    content: str | list["Part"]
    is_error: bool = False
    name: str | None = None


@dataclass(slots=True)
class ImagePart:
    media_type: str | None = None
    data: str | None = None  # base64
    url: str | None = None


@dataclass(slots=True)
class DocumentPart:
    """A document (or an Anthropic search result): `text` renders into the prompt after the header lines its
    `title`, `source` and `context` give, when present; binary `data` only reaches models that take it."""

    media_type: str | None = None
    data: str | None = None
    text: str | None = None
    title: str | None = None
    source: str | None = None
    context: str | None = None


Part = Union[TextPart, ReasoningPart, ToolCallPart, ToolResultPart, ImagePart, DocumentPart]

Role = Literal["system", "developer", "user", "assistant", "tool"]


@dataclass(slots=True)
class Message:
    role: Role
    parts: list[Part] = field(default_factory=list)


@dataclass(slots=True)
class ToolSpec:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    kind: Literal["function", "custom"] = "function"  # custom = freeform text input (Responses)


@dataclass(slots=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "tool"] = "auto"
    name: str | None = None  # for mode == "tool"
    parallel: bool = True
    # auto / required: only these tools may be called (OpenAI's `allowed_tools`); every tool stays in the prompt, so
    # the cached prefix does not change with the choice. None: any of the tools.
    allowed: tuple[str, ...] | None = None


@dataclass(slots=True)
class Conversation:
    messages: list[Message] = field(default_factory=list)
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)


@dataclass(slots=True)
class AgentHints:
    """`nvext.agent_hints`: scheduling hints from the harness."""

    priority: int | None = None
    osl: int | None = None  # expected output length, for the router's decode-load estimate
    speculative_prefill: bool = False
    latency_sensitivity: float | None = None


@dataclass(slots=True)
class OutputFormat:
    """A constraint on the answer's text, enforced by the engine's grammar (Chat `response_format`, Responses
    `text.format`, Anthropic `output_config.format`). `schema` is None for any JSON object."""

    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = True


@dataclass(slots=True)
class GenerationOptions:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    frequency_penalty: float | None = None  # Chat's sampling penalties and token biases, as vLLM applies them
    presence_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    thinking: bool | None = None  # None = the model's default; False = the client disabled thinking
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    session_key: str | None = None  # sticky-routing tie-breaker (Claude Code session id, prompt_cache_key, ...)
    # Who the session is for, the same across their sessions (Claude Code's account and device, OpenAI's
    # safety_identifier or user): the front door's guess at a first turn's tenant (routing/front_door.py).
    user_key: str | None = None
    # The front door's route id for this request (`<Router replica>/<x-request-id>`, routing/types.ROUTE_ID_HEADER)
    # when its Router chose this replica (`router.front_door`): the Router's load for it is reported under this id.
    route_id: str | None = None
    hints: AgentHints = field(default_factory=AgentHints)
    forced_script: str | None = None  # test configs only: the exact text the engine must emit
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens (benchmarks)
    min_tokens: int = 0
    output_format: OutputFormat | None = None  # None = free text
    # The last message is an assistant turn to continue (Anthropic prefill): the prompt ends with its text, with
    # no end of turn and no new generation prompt, and the output is only the continuation.
    continue_final: bool = False


# --------------------------------------------------------------------------------------------------------------
# Semantic events (response side)


@dataclass(slots=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True)
class TextDelta:
    text: str


@dataclass(slots=True)
class AnswerFromReasoning(TextDelta):
    """The turn's reasoning given again as its answer, at the end of a turn that had reasoning and nothing else, when
    the request asked for a non-empty answer (`parsers.answer_required`). Streaming, it is text like any other (the
    client has already seen the reasoning, as from vLLM); a complete answer carries it once, as the answer
    (`complete_answer`)."""


@dataclass(slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(slots=True)
class ToolCallArgsDelta:
    index: int
    arguments: str  # a fragment; one call's fragments concatenate to a valid JSON object


@dataclass(slots=True)
class ToolCallEnd:
    index: int


@dataclass(slots=True)
class Usage:
    """Token counts. `GenerationService.stream` yields one `estimated=True` Usage first, as soon as the request
    is routed (prompt tokens exact, cached tokens as the router predicts them), so an API that must announce
    usage before the first token (Anthropic `message_start`) can; the exact figures come in the last Usage."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    estimated: bool = False


# "length": the client's max_tokens was reached (or the model's output cap, where the client asked for nothing
# more). "output_cap": the model's output cap in the service's config stopped generation below the max_tokens the
# client asked for (a limit of this deployment, not of the request). "context_window": generation stopped
# because the context window was full, before either of those (max_tokens was clamped to the room left); each API
# reports the two as its vendor does (docs/limits.md).
FinishReason = Literal["stop", "length", "output_cap", "context_window", "tool_calls", "stop_sequence", "error",
                       "abort"]


@dataclass(slots=True)
class Finish:
    reason: FinishReason
    stop_sequence: str | None = None
    error: str | None = None
    error_kind: str | None = None  # a serve_app.errors.ErrorKind when reason == "error" (e.g. "overloaded")
    retry_after: float | None = None  # seconds, where the error says when to retry (an engine being replaced)


Event = Union[ReasoningDelta, TextDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd, Usage, Finish]
ParserEvent = Union[ReasoningDelta, TextDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd]


def drop_abandoned_calls(events: list[Event]) -> list[Event]:
    """The events without abandoned calls: a ToolCallStart never followed by its ToolCallEnd (cut off by the end,
    or malformed after it began streaming; its raw text follows as TextDelta). A complete answer never has them."""
    ended = {ev.index for ev in events if isinstance(ev, ToolCallEnd)}
    return [ev for ev in events if not isinstance(ev, (ToolCallStart, ToolCallArgsDelta)) or ev.index in ended]


class HeldCalls:
    """Holds a tool call back until it ends, for an encoder whose client must not see a call it would run before
    the call is complete: `push(ev)` gives the events to encode in place of `ev` — nothing while a held call
    streams, then the whole call at its `ToolCallEnd` (start, all its arguments as one fragment, end). Any other
    event while a call is held means the parser abandoned it (cut off, or malformed; its raw text follows as
    text): the call is dropped unsent, so the stream encodes exactly what `drop_abandoned_calls` leaves."""

    __slots__ = ("held", "_start", "_args")

    def __init__(self, held: Callable[[str], bool] = lambda name: True):
        self.held = held  # which tools' calls are held (by name)
        self._start: ToolCallStart | None = None
        self._args: list[str] = []

    def push(self, ev: Event) -> list[Event]:
        start = self._start
        if start is not None and not isinstance(ev, Usage):  # usage is not the model's output
            if isinstance(ev, ToolCallArgsDelta) and ev.index == start.index:
                self._args.append(ev.arguments)
                return []
            self._start = None
            if isinstance(ev, ToolCallEnd) and ev.index == start.index:
                args = "".join(self._args)
                return [start, ToolCallArgsDelta(start.index, args), ev] if args else [start, ev]
        if isinstance(ev, ToolCallStart) and self.held(ev.name):
            self._start, self._args = ev, []
            return []
        return [ev]


def complete_answer(events: list[Event]) -> list[Event]:
    """What a complete (non-streaming) answer carries of a stream: no abandoned calls, and where the reasoning was
    given again as the answer (AnswerFromReasoning), the answer alone: the reasoning, the whitespace-only text beside
    it and its token count move into the answer, as vLLM's non-streaming path swaps them."""
    events = drop_abandoned_calls(events)
    if not any(isinstance(ev, AnswerFromReasoning) for ev in events):
        return events
    out: list[Event] = []
    for ev in events:
        if isinstance(ev, AnswerFromReasoning):
            out.append(TextDelta(ev.text))
        elif isinstance(ev, Usage) and not ev.estimated:
            out.append(replace(ev, reasoning_tokens=0))
        elif not isinstance(ev, ReasoningDelta) and not (isinstance(ev, TextDelta) and not ev.text.strip()):
            out.append(ev)
    return out


def fold_events(events: list[Event]) -> list[Part]:
    """Fold a stream of parser events into assistant parts (what a non-streaming response carries).

    Adjacent deltas of the same kind merge; order between reasoning, text and tool calls is kept.
    """
    parts: list[Part] = []
    calls: dict[int, ToolCallPart] = {}
    for ev in events:
        if isinstance(ev, TextDelta):
            if parts and isinstance(parts[-1], TextPart):
                parts[-1].text += ev.text
            elif ev.text:
                parts.append(TextPart(ev.text))
        elif isinstance(ev, ReasoningDelta):
            if parts and isinstance(parts[-1], ReasoningPart):
                parts[-1].text += ev.text
            elif ev.text:
                parts.append(ReasoningPart(ev.text))
        elif isinstance(ev, ToolCallStart):
            call = ToolCallPart(id=ev.id, name=ev.name, arguments="")
            calls[ev.index] = call
            parts.append(call)
        elif isinstance(ev, ToolCallArgsDelta):
            calls[ev.index].arguments += ev.arguments
    return parts
