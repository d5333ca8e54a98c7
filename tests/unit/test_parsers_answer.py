"""A non-empty answer on request (parsers/answer.py; vLLM's force_nonempty_content): a turn that is only reasoning
gives it again as its answer, however the text is split; a turn with an answer or a call is left alone."""

from __future__ import annotations

import random

import pytest

from serve_app.conversation import (AnswerFromReasoning, ReasoningDelta, ReasoningPart, TextDelta, TextPart,
                                    ToolCallPart, Usage, complete_answer, fold_events)
from serve_app.parsers import answer_required, fold_complete, parse_complete
from test_parsers_formats import stream

SCHEMAS = [{"type": "function", "function": {"name": "read", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]

# (reasoning format, tool format, prompt opens the think block, model output, the complete answer's parts)
CASES = [
    # the model never closed its think block (cut off, or it stopped inside it)
    ("nemotron_v3", "qwen3_coder", True, "The answer is 4, since 2 + 2 = 4.",
     [TextPart("The answer is 4, since 2 + 2 = 4.")]),
    # it opened one itself with the prompt's block closed (thinking off)
    ("nemotron_v3", None, False, "<think>Only a thought.\nTwo lines.", [TextPart("Only a thought.\nTwo lines.")]),
    # closed, with only whitespace after it
    ("qwen3", "hermes", False, "<think>Plan: nothing to do.</think>\n\n", [TextPart("Plan: nothing to do.")]),
    # a real answer: nothing moves
    ("nemotron_v3", None, True, "reasoning here</think>real answer",
     [ReasoningPart("reasoning here"), TextPart("real answer")]),
    # a finished call is an answer
    ("qwen3", "hermes", True,
     'Read it.</think>\n<tool_call>\n{"name": "read", "arguments": {"path": "a"}}\n</tool_call>',
     [ReasoningPart("Read it."), TextPart("\n"), "call"]),
    # a call cut off by the end gives its text back as text: that is an answer too
    ("qwen3", "hermes", True, 'Read it.</think><tool_call>\n{"name": "read", "argu',
     [ReasoningPart("Read it."), TextPart('<tool_call>\n{"name": "read", "argu')]),
    # Harmony: analysis only
    ("gpt_oss", "openai", False, "<|channel|>analysis<|message|>Thinking about it.<|end|>",
     [TextPart("Thinking about it.")]),
    # nothing at all: nothing to give
    ("nemotron_v3", None, True, "", []),
]


def shape(parts):
    return ["call" if isinstance(p, ToolCallPart) else p for p in parts]


@pytest.mark.parametrize("case", CASES, ids=[c[3][:24] or "empty" for c in CASES])
def test_only_reasoning_becomes_the_answer_in_any_split(case):
    reasoning, tools, opens, text, want = case
    kw = dict(reasoning=reasoning, tools=tools, tool_schemas=SCHEMAS, starts_in_reasoning=opens, answer_required=True)
    whole = parse_complete(text, **kw)
    assert shape(fold_complete(whole)) == want
    rng = random.Random(text)
    n = len(text)
    splits = [sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 10)))) for _ in range(30)] if n > 1 else []
    for cuts in [*splits, list(range(1, n))]:
        events = stream(text, cuts, **kw)
        assert shape(fold_events(events)) == shape(fold_events(whole)), cuts  # what a streaming client sees
        assert shape(fold_complete(events)) == want, cuts  # what a complete answer carries
    # streamed, the client has seen the reasoning; the answer repeats all of it, once, at the end
    given = [e for e in whole if isinstance(e, AnswerFromReasoning)]
    assert len(given) == (1 if len(want) == 1 else 0)  # the cases above: one part left means it was given
    if given:
        assert whole[-1] is given[0]
        assert given[0].text == "".join(e.text for e in whole if isinstance(e, ReasoningDelta))


@pytest.mark.parametrize("case", CASES, ids=[c[3][:24] or "empty" for c in CASES])
def test_without_the_option_nothing_is_added(case):
    reasoning, tools, opens, text, _ = case
    events = parse_complete(text, reasoning=reasoning, tools=tools, tool_schemas=SCHEMAS, starts_in_reasoning=opens)
    assert not any(isinstance(e, AnswerFromReasoning) for e in events)


def test_the_complete_answer_carries_it_once():
    events = [Usage(10, 0, estimated=True), ReasoningDelta("Think"), ReasoningDelta("ing."), TextDelta("\n\n"),
              AnswerFromReasoning("Thinking."), Usage(10, 5, reasoning_tokens=5)]
    out = complete_answer(events)
    assert out == [Usage(10, 0, estimated=True), TextDelta("Thinking."), Usage(10, 5, reasoning_tokens=0)]
    assert type(out[1]) is TextDelta
    plain = [ReasoningDelta("a"), TextDelta(" "), Usage(1, 1, reasoning_tokens=1)]
    assert complete_answer(plain) == plain  # no answer given: the stream as it was


def test_who_asks_for_it():
    # the request's option, for any reasoning format
    assert answer_required("qwen3", {"force_nonempty_content": True}, None)
    assert answer_required("gpt_oss", {"force_nonempty_content": True}, True)
    assert not answer_required("qwen3", {"force_nonempty_content": "yes"}, None)  # only a real true
    # thinking off asks for it where the format's row says so (vLLM's nemotron_v3)
    assert answer_required("nemotron_v3", {}, False)
    assert answer_required("nemotron_v3", {"enable_thinking": False}, None)
    assert not answer_required("nemotron_v3", {}, None)
    assert not answer_required("nemotron_v3", {"enable_thinking": True}, True)
    assert not answer_required("qwen3", {"enable_thinking": False}, False)
    # no reasoning format: no reasoning to give
    assert not answer_required(None, {"force_nonempty_content": True}, False)
