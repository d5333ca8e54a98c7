"""A scripted coding-agent session per family, through each API, at text and token level (no engine).

Three model turns: think + parallel tool calls; think + an answer (then a new user query); think + a call. Each
turn's output is what a model trained on the family's template generates (`emitted_text`: the template's own
rendering of that turn), parsed with the family's parsers, sent through the API's real encoder, appended as the
client sends it back and rendered again. Per turn: the tokens of turn N's cache (prompt + generated) that turn
N+1's prompt reuses, and — where it does not reuse all of them — the think blocks the template dropped by design
(anything else is a failure). Used by tests/unit/test_families_prefix.py and load/prefix_families.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from serve_app.conversation import ReasoningPart, TextPart, ToolCallPart
from serve_app.families import Family
from serve_app.parsers import TOOL_PARSERS, parse_complete
from serve_app.parsers.formats import tool_start_markers
from tests.support.stability import (
    agent_request,
    api_conversation,
    api_next_turn,
    check_turn,
    dropped_blocks,
    emitted_text,
)

APIS = ("anthropic", "responses", "chat")
SECRET = b"family-session-secret"
HEADER = "x-anthropic-billing-header: cc_version=2.1.197.c0f; cc_entrypoint=cli;"
SYSTEM = "You are a coding agent. Work in the repository and use the tools."
USER = "List the files and tell me the entry point."
TOOLS = [
    ("ls", "List files in a directory.", {"type": "object", "properties": {"path": {"type": "string"}},
                                          "required": ["path"]}),
    ("read_file", "Read a file.", {"type": "object", "properties": {"path": {"type": "string"},
                                                                    "limit": {"type": "integer"}},
                                   "required": ["path"]}),
]
# (reasoning, text, calls, the user's next message when no tool was called)
TURNS = [
    ("I should look at the files first.", "", [("ls", {"path": "."}), ("read_file", {"path": "README.md", "limit": 20})],
     ""),
    ("The listing shows two files, and the README names the entry point.",
     "There are two files: a.py and b.py. The entry point is a.py.", [], "Now count the lines of a.py."),
    ("I need to read a.py to count its lines.", "", [("read_file", {"path": "a.py"})], ""),
]


@dataclass(slots=True)
class TurnResult:
    family: str
    api: str
    thinking: bool
    turn: int  # turn N → N+1
    reused: int  # tokens of turn N's cache that N+1's prompt starts with
    cached: int  # turn N's prompt + generated tokens
    dropped: list[str] | None  # think blocks the template dropped; None: a divergence that is not one

    @property
    def fraction(self) -> float:
        return self.reused / self.cached if self.cached else 1.0

    @property
    def ok(self) -> bool:
        return self.dropped is not None and (self.reused == self.cached) == (not self.dropped)


def turn_parts(fam: Family, thinking: bool, reasoning: str, text: str, calls: list, first_id: int) -> list:
    """The turn as the family's template can express it (see the catalog's flags)."""
    if calls and not fam.parallel_calls:
        calls = calls[:1]
    keep_reasoning = thinking and fam.reasoning_parser and (fam.reasoning_with_calls if calls
                                                            else fam.reasoning_with_answers)
    parts: list = [ReasoningPart(reasoning)] if keep_reasoning else []
    if text and (not calls or ((not keep_reasoning or fam.text_reasoning_and_calls) and fam.text_before_calls)):
        parts.append(TextPart(text))
    for i, (name, args) in enumerate(calls):
        cid = f"functions.{name}:{first_id + i}" if fam.tool_parser == "kimi_k2" else f"call_{first_id + i}"
        parts.append(ToolCallPart(cid, name, json.dumps(args)))
    return parts


# What a dropped think block may hold besides the thought: markers, whitespace, and the header words of the
# message it was (gpt-oss drops a whole `<|channel|>analysis<|message|>…<|end|><|start|>assistant` message), or
# its channel's label (Gemma 4's `<|channel>thought\n…<channel|>`).
_MARKUP = re.compile(r"<[^<>]{0,40}>|\s+|\b(?:assistant|analysis|thought)\b")


def only_markup(block: str, reasoning: list[str]) -> bool:
    for r in reasoning:
        block = block.replace(r, "")
    return not _MARKUP.sub("", block)


# Marker strings the families' tokenizers split out as single (special or added) tokens. The sessions run on a
# small stand-in tokenizer; giving it the same splits keeps seams where the real tokenizer has them.
_MARKERS = re.compile(r"<\|[^|<>\s]{1,40}\|>|<｜[^｜<>\s]{1,40}｜>|</?(?:think|tool_call|tool_response|arg_key|arg_value)>"
                      r"|</?minimax:tool_call>|\[e~\[|\]~b\]|\]~!b\["
                      r"|\[/?(?:INST|THINK|SYSTEM_PROMPT|AVAILABLE_TOOLS|TOOL_RESULTS|TOOL_CALLS|ARGS|IMG)\]")


def family_tokenizer(source: str, fam: Family):
    """A tokenizer from `source` with the family's template and its marker strings added as tokens."""
    from transformers import AddedToken

    from serve_app.prompt import load_tokenizer

    tok = load_tokenizer(source, str(fam.template_path))
    text = fam.template_text()
    markers = sorted(set(_MARKERS.findall(text)) | set(fam.turn_ends(tok.eos_token)))
    known = set(tok.get_vocab())
    tok.add_tokens([AddedToken(m, special=True, normalized=False) for m in markers if m not in known])
    return tok


def thinking_cases(fam: Family) -> tuple[bool, ...]:
    """With and without thinking, where the template lets a request choose."""
    if not fam.reasoning_parser:
        return (False,)
    return (True, False) if fam.thinking_can_be_disabled else (True,)


def family_renderer(source: str, fam: Family):
    from serve_app.prompt import PromptRenderer
    from serve_app.settings import ModelConfig

    return PromptRenderer(family_tokenizer(source, fam), ModelConfig(id="m", family=fam.name, family_template=True))


def run_session(renderer, fam: Family, api: str, thinking: bool) -> list[TurnResult]:
    tok = renderer.tokenizer
    schemas = [{"type": "function", "function": {"name": n, "description": d, "parameters": s}}
               for n, d, s in TOOLS]
    body = agent_request(api, thinking, SYSTEM, USER, TOOLS, HEADER)
    conv, opts = api_conversation(api, body, SECRET)
    results: list[TurnResult] = []
    said: list[str] = []
    next_id = 0
    for n, (reasoning, text, calls, next_user) in enumerate(TURNS, 1):
        parts = turn_parts(fam, thinking, reasoning, text, calls, next_id)
        next_id += sum(isinstance(p, ToolCallPart) for p in parts)
        said += [p.text for p in parts if isinstance(p, ReasoningPart)]
        stops = fam.turn_ends(tok.eos_token)
        prompt_text, script, starts = emitted_text(renderer, conv, parts, opts, stops,
                                                   tool_start_markers(TOOL_PARSERS[fam.tool_parser]))
        prompt = renderer.render_sync(conv, opts)
        assert prompt.text == prompt_text
        events = parse_complete(script, reasoning=fam.reasoning_parser, tools=fam.tool_parser, tool_schemas=schemas,
                                starts_in_reasoning=starts)
        body, conv, opts = api_next_turn(api, body, events, SECRET, next_user or "Go on.")
        nxt = renderer.render_sync(conv, opts)
        # The end-of-turn token the model generated is whichever stop token the template writes after the turn.
        tail = script[-40:]
        at = nxt.text.find(tail, max(0, len(prompt_text) - 2 * len(script) - 4096)) if tail else -1
        after = nxt.text[at + len(tail):] if at >= 0 else ""
        stop = next((t for t in stops if after.startswith(t)), "")
        generated = tok.encode(script, add_special_tokens=False) + tok.encode(stop, add_special_tokens=False)
        result = check_turn(prompt.token_ids, generated, nxt.token_ids)
        # "": an empty think block (thinking off) that the template drops like a full one.
        dropped = dropped_blocks(prompt_text + script + stop, nxt.text, [*said, ""])
        if dropped is not None and not all(only_markup(b, said) for b in dropped):
            dropped = None
        results.append(TurnResult(fam.name, api, thinking, n, result.reused, len(result.cached), dropped))
    return results
