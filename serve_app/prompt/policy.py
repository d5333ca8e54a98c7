"""How a model's template wants earlier reasoning replayed, decided once per model from its template.

Turn N+1 must reproduce turn N's prompt + generated tokens or the KV cache is lost, so replay follows what the
template does with history:

- `field`: the template reads `reasoning_content` → hand each assistant turn's reasoning there and let the
  template decide (Qwen3, GLM, Kimi, MiniMax, Nemotron templates do).
- `drop`: the template cuts content at the end-of-thinking marker (DeepSeek-R1 style: the model is trained
  without prior thinking) → reasoning of turns without tool calls is dropped; tool-call turns keep theirs inline.
- `inline`: anything else → reasoning goes back into content between the model's own markers, exactly as it was
  generated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from serve_app.parsers import REASONING_PARSERS, TOOL_PARSERS
from serve_app.parsers.formats import tool_start_markers

_DEFAULT_MARKERS = ("<think>", "</think>")  # for a reasoning parser name the registry does not know

ReplayMode = Literal["field", "inline", "drop"]


def reasoning_markers(parser: str | None) -> tuple[str, str] | None:
    """(start, end) markers of a reasoning parser, from `serve_app.parsers` when it knows the name."""
    if not parser:
        return None
    fmt = REASONING_PARSERS.get(parser)
    return (fmt.start, fmt.end) if fmt is not None else _DEFAULT_MARKERS


def unwritten_markers(template: str, reasoning_parser: str | None, tool_parser: str | None) -> list[str]:
    """The parsers' markers a chat template never writes: the reasoning parser's end marker, or every start marker
    of the tool parser. A model trained on that template does not write them either, so the parsers belong to
    another family than the template (a `family` entry served with a checkpoint whose own template differs, or a
    parser name set by hand) and its answers would be parsed wrongly."""
    out = []
    markers = reasoning_markers(reasoning_parser)
    if markers and markers[1] not in template:
        out.append(f"{markers[1]!r} ({reasoning_parser} reasoning)")
    starts = tool_start_markers(TOOL_PARSERS[tool_parser]) if tool_parser in TOOL_PARSERS else ()
    if starts and not any(m in template for m in starts):
        out.append(" / ".join(map(repr, starts)) + f" ({tool_parser} tool calls)")
    return out


@dataclass(frozen=True, slots=True)
class ReplayPolicy:
    mode: ReplayMode
    markers: tuple[str, str] | None  # the reasoning parser's (start, end), None without a reasoning parser
    # What the generation prompt already opened (e.g. "<think>\n"): the model's reasoning text starts after it,
    # so an inline replay puts it back in front. Without it, the model wrote just the start marker itself.
    opener: str = ""
    arguments_as_string: bool = False  # the template prints a string `arguments` verbatim (byte-exact replay)
    developer_role: bool = False  # the template knows the developer role; otherwise developer → system
    # The template takes one system message, and only first (Qwen3.6 raises on any other; MiniMax-M2 drops them,
    # gpt-oss a later one): a run of leading system/developer messages is joined into one, and a later one goes in
    # as a user message where it stands (the prompt stays append-only, so the prefix cache holds). Found by probing.
    merge_leading_system: bool = False
    later_system_as_user: bool = False
    # The template makes user and assistant turns alternate (Mistral's raise on two user turns in a row): a user
    # message after another is joined to it, and user text after tool results goes into the last result (Anthropic
    # and Codex send the results and the text after them as one user turn). Found by probing.
    merge_user_runs: bool = False
    user_text_into_tool_result: bool = False
    # The template refuses an assistant turn with neither text nor calls (Mistral's raise; the model wrote only its
    # end token) but takes content as one empty text block, which renders the same nothing: such a turn goes in
    # that way. Found by probing.
    empty_turn_as_blocks: bool = False
    fields: tuple[str, ...] = ()  # field mode: the message keys that carry reasoning to the template
    # Thinking off: the generation prompt may close an empty think block itself ("<think>\n\n</think>\n\n"),
    # so every answer was generated after it. `empty_replay` is how a turn without reasoning gets that block
    # back ("field": whitespace-only reasoning in the fields; "inline": the block in front of the content;
    # "none": the template renders it already, or no representation round-trips). Found by probing the template.
    empty_block: str = ""
    empty_replay: Literal["none", "field", "inline"] = "none"
    # Field mode: what the template writes around a reasoning field and an assistant text itself (e.g. Nemotron's
    # "<think>\n" + reasoning + "\n</think>\n"), which the parser hands back as part of the reasoning or text it
    # parsed. Replay takes it off again, or the next turn would render it twice. (prefix, suffix) pairs, found by
    # rendering a probe turn and parsing it with the model's own parsers; text differs before calls and at the end.
    reasoning_affixes: tuple[str, str] = ("", "")
    text_affixes: tuple[str, str] = ("", "")  # text followed by tool calls
    answer_affixes: tuple[str, str] = ("", "")  # text that ends the turn
    lead_text: str = ""  # whitespace the template writes before the think block, parsed as text
    # Drop mode: a tool-call turn keeps its reasoning inline (R1 style). False where the template writes its own
    # empty think block in front of a tool-call turn's content (DeepSeek-V3.1): inlined reasoning would become a
    # second think block the model never wrote, so it is dropped like an answer's.
    inline_tool_reasoning: bool = True


# The message keys templates read reasoning from: `reasoning_content` (Qwen3, GLM, Kimi, MiniMax, Nemotron),
# `reasoning` (vLLM's newer name) and `thinking` (gpt-oss). Matched as a message attribute or subscript.
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def reasoning_fields(template: str) -> tuple[str, ...]:
    """The reasoning keys the template's text reads. A read may be of something else (Ministral 3 reads
    `block['thinking']` of content blocks), so the renderer keeps only those a probe render shows."""
    return tuple(k for k in _REASONING_KEYS if _reads(template, k))


def _reads(template: str, key: str) -> bool:
    return re.search(r"\.%s\b|\[\s*['\"]%s['\"]\s*\]|\.get\(\s*['\"]%s['\"]" % (key, key, key), template) is not None
_ARGS_STRING = re.compile(r"arguments['\"\]]*\s*\)?\s*is\s+(?:not\s+)?string")
# A template that tests `arguments is mapping` writes a dict in its own notation (Gemma 4: `key:<|"|>v<|"|>`);
# its `is string` branch is a fallback for text already in that notation (Gemma 4 wraps it in braces), not a
# place to print JSON verbatim. Such a template gets the dict, as vLLM hands every template.
_ARGS_MAPPING = re.compile(r"arguments['\"\]]*\s*\)?\s*is\s+mapping")


def decide_policy(template: str, reasoning_parser: str | None, generation_tail: str = "",
                  fields: tuple[str, ...] | None = None) -> ReplayPolicy:
    """`generation_tail` is the end of a probe render with the generation prompt (to find the opener). `fields`:
    the message keys the template was seen to render reasoning from (None: those its text reads)."""
    markers = reasoning_markers(reasoning_parser)
    if fields is None:
        fields = reasoning_fields(template)
    if fields:
        mode: ReplayMode = "field"
    elif markers and re.search(r"split\(\s*['\"]" + re.escape(markers[1]) + r"['\"]", template):
        mode = "drop"
    elif markers:
        mode = "inline"
    else:
        mode = "drop"  # no markers to put reasoning back in: the model never saw its thinking as text
    opener = ""
    if markers:
        start = markers[0]
        at = generation_tail.rfind(start)
        if at >= 0 and markers[1] not in generation_tail[at:]:
            opener = generation_tail[at:]
        else:
            opener = start
    return ReplayPolicy(
        mode=mode,
        markers=markers,
        opener=opener,
        arguments_as_string=bool(_ARGS_STRING.search(template)) and not _ARGS_MAPPING.search(template),
        developer_role=bool(re.search(r"['\"]developer['\"]", template)),
        fields=fields,
    )


def closed_empty_block(generation_tail: str, markers: tuple[str, str] | None) -> str:
    """The empty think block a thinking-off generation prompt ends with ("" when it has none)."""
    if not markers:
        return ""
    start, end = markers
    at = generation_tail.rfind(start)
    if at < 0:
        return ""
    block = generation_tail[at:]
    inner = block[len(start):]
    close = inner.find(end)
    if close < 0 or inner[:close].strip() or inner[close + len(end):].strip():
        return ""
    return block


def ends_in_reasoning(text: str, markers: tuple[str, str] | None) -> bool:
    """True when the rendered prompt leaves a think block open (the model starts generating reasoning)."""
    if not markers:
        return False
    start, end = markers
    at = text.rfind(start)
    return at >= 0 and end not in text[at + len(start):] and not text[at + len(start):].strip()


def prompt_starts_in_reasoning(text: str, markers: tuple[str, str] | None, turn_starts: tuple[str, ...],
                               format_default: bool, answer: tuple[str, ...] = ()) -> bool:
    """Where the model's output begins: inside reasoning when the prompt leaves a think block open; not when
    the generation prompt closed one (thinking off) or opened the answer's own tag (Kimi K3's response channel,
    `answer`: the format's answer tags); otherwise the format's own default (an R1-style model starts thinking
    without writing the start marker)."""
    if not markers:
        return False
    if ends_in_reasoning(text, markers):
        return True
    if answer and text.rstrip().endswith(answer):
        return False
    at = max((text.rfind(s) for s in turn_starts), default=-1)
    tail = text[at:] if at >= 0 else text[-256:]
    return False if markers[0] in tail else format_default
