"""Fixture table per format plus the split-invariance properties (vLLM's test_streaming_split_invariance, applied
to every fixture): 100 seeded random splits and one-character deltas fold to exactly what parse_complete gives."""

from __future__ import annotations

import json
import random

import pytest

from parser_cases.cases import BIG, all_fixtures
from parser_cases.wire import FORMATS, schemas_for
from serve_app.conversation import (ReasoningDelta, ReasoningPart, TextDelta, TextPart, ToolCallArgsDelta,
                                    ToolCallEnd, ToolCallPart, ToolCallStart)
from serve_app.parsers import fold_complete, make_stream_parser, parse_complete

FIXTURES = all_fixtures()
IDS = [f[0] for f in FIXTURES]


def kwargs(fmt, segs):
    kw = {"reasoning": fmt.reasoning, "tools": fmt.tools, "starts_in_reasoning": False}
    if fmt.typed_by_schema:
        kw["tool_schemas"] = schemas_for(segs)
    return kw


def simple(parts) -> list:
    """Folded parts without the random ids, arguments decoded."""
    out = []
    for p in parts:
        if isinstance(p, TextPart):
            out.append(("text", p.text))
        elif isinstance(p, ReasoningPart):
            out.append(("reasoning", p.text))
        elif isinstance(p, ToolCallPart):
            out.append(("call", p.name, json.loads(p.arguments)))
    return out


def stream(text: str, cuts: list[int], **kw) -> list:
    p = make_stream_parser(**kw)
    events = []
    prev = 0
    for c in cuts + [len(text)]:
        events += p.push(text[prev:c])
        prev = c
    return events + p.finish()


def check_events(events, markers=()):
    """Invariants on any event stream: ids unique, indexes increasing, each ended call's fragments form a JSON
    object, no markup in any text."""
    ids, starts, args, ended = set(), [], {}, set()
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.id not in ids
            ids.add(e.id)
            assert e.index == len(starts)
            starts.append(e.index)
            args[e.index] = []
        elif isinstance(e, ToolCallArgsDelta):
            assert e.index not in ended
            args[e.index].append(e.arguments)
        elif isinstance(e, ToolCallEnd):
            ended.add(e.index)
            assert isinstance(json.loads("".join(args[e.index])), dict)
        for m in markers:
            for field in ("text", "arguments", "name"):
                assert m not in (getattr(e, field, "") or ""), (m, e)


@pytest.mark.parametrize("case", FIXTURES, ids=IDS)
def test_fixture_folds_to_expected(case):
    _, fmt, wire, want, segs = case
    events = parse_complete(wire, **kwargs(fmt, segs))
    check_events(events, markers=fmt.markers + ((fmt.think if fmt.reasoning else ())))
    assert simple(fold_complete(events)) == [tuple(x) for x in want]


@pytest.mark.parametrize("case", FIXTURES, ids=IDS)
def test_split_invariance(case):
    name, fmt, wire, _, segs = case
    kw = kwargs(fmt, segs)
    whole = simple(fold_complete(parse_complete(wire, **kw)))
    rng = random.Random(name)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(wire)), min(len(wire) - 1, rng.randint(1, 40))))
        ev = stream(wire, cuts, **kw)
        check_events(ev, markers=fmt.markers)
        assert simple(fold_complete(ev)) == whole
    ev = stream(wire, list(range(1, len(wire))), **kw)  # one character per delta
    check_events(ev, markers=fmt.markers)
    assert simple(fold_complete(ev)) == whole


def test_big_argument_streams_incrementally():
    """The 20 KB value arrives in many fragments while it is generated, not in one piece at the end."""
    for fmt in FORMATS:
        if fmt.tools == "pythonic":
            continue  # pythonic calls are emitted whole at their closing parenthesis (documented)
        segs = [("calls", [("write_file", {"path": "a", "content": BIG})])]
        wire = fmt.render(segs[0][1])
        p = make_stream_parser(**kwargs(fmt, segs))
        frags_before_end = 0
        for k in range(0, len(wire), 16):
            for e in p.push(wire[k:k + 16]):
                frags_before_end += isinstance(e, ToolCallArgsDelta)
        assert frags_before_end > 500, fmt.tools


# -- malformed, truncated, missing end markers --------------------------------------------------------------------

MALFORMED = {  # format -> (wire, expected fold): degrade to text before the call commits
    "hermes": ("Sure. <tool_call>this is not json</tool_call>", [("text", "Sure. <tool_call>this is not json</tool_call>")]),
    "qwen3_coder": ("Sure. <tool_call>\nnot xml\n</tool_call>", [("text", "Sure. <tool_call>\nnot xml\n</tool_call>")]),
    "llama3_json": ("<|python_tag|>not json", [("text", "<|python_tag|>not json")]),
    "mistral": ("[TOOL_CALLS]not a call", [("text", "[TOOL_CALLS]not a call")]),
    "deepseek_v3": ("x<｜tool▁calls▁begin｜>junk<｜tool▁calls▁end｜>", [("text", "x<｜tool▁calls▁begin｜>junk<｜tool▁calls▁end｜>")]),
    "kimi_k2": ("<|tool_calls_section_begin|>junk<|tool_calls_section_end|>", [("text", "<|tool_calls_section_begin|>junk<|tool_calls_section_end|>")]),
    "deepseek_v32": ("<｜DSML｜function_calls>junk</｜DSML｜function_calls>", [("text", "<｜DSML｜function_calls>junk</｜DSML｜function_calls>")]),
    "glm47": ("<tool_call>not a name</tool_call>", [("text", "<tool_call>not a name</tool_call>")]),
    "minimax_m2": ("<minimax:tool_call>junk</minimax:tool_call>", [("text", "<minimax:tool_call>junk</minimax:tool_call>")]),
    "pythonic": ("[not a call] ok", [("text", "[not a call] ok")]),
    "openai": ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>oops<|call|>",
               [("text", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>oops")]),
}


@pytest.mark.parametrize("tools", sorted(MALFORMED))
def test_malformed_call_degrades_to_text(tools):
    wire, want = MALFORMED[tools]
    whole = simple(fold_complete(parse_complete(wire, tools=tools)))
    assert whole == want
    rng = random.Random(tools)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(wire)), rng.randint(1, min(10, len(wire) - 1))))
        assert simple(fold_complete(stream(wire, cuts, tools=tools))) == whole
    assert simple(fold_complete(stream(wire, list(range(1, len(wire))), tools=tools))) == whole


BAD_ARGS = {  # malformed JSON inside the arguments, after the call started streaming: abandoned, shown as text
    "hermes": '<tool_call>{"name": "f", "arguments": {"a": 1,,}}</tool_call>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": tru}",
    "deepseek_v31": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a" 1}<｜tool▁call▁end｜>',
    "mistral": '[TOOL_CALLS]f[ARGS]{"a": [1, }',
    "openai": '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": }<|call|>',
}


@pytest.mark.parametrize("tools", sorted(BAD_ARGS))
def test_malformed_arguments_never_complete_a_call(tools):
    wire = "Before. " + BAD_ARGS[tools]
    for cuts in ([], list(range(1, len(wire))), [10, 20, 30]):
        events = stream(wire, cuts, tools=tools)
        check_events(events)
        assert not any(isinstance(e, ToolCallEnd) for e in events)
        folded = simple(fold_complete(events))
        assert folded and folded[0][0] == "text" and folded[0][1].startswith("Before. ")
        assert all(p[0] == "text" for p in folded)


TRUNCATED_FORMATS = [f for f in FORMATS]


@pytest.mark.parametrize("fmt", TRUNCATED_FORMATS, ids=[f.tools for f in TRUNCATED_FORMATS])
def test_call_cut_off_by_end_of_stream_is_dropped(fmt):
    segs = [("calls", [("write_file", {"path": "a.py", "content": "print('hello world, this is long')"})])]
    wire = fmt.render(segs[0][1])
    cut = wire.index("hello world") + 5
    prefix = "Before. " if fmt.text_before_calls else ""
    text = prefix + wire[:cut]
    kw = kwargs(fmt, segs)
    for cuts in ([], list(range(1, len(text)))):
        events = stream(text, cuts, **kw)
        check_events(events, markers=fmt.markers)
        assert not any(isinstance(e, ToolCallEnd) for e in events)
        assert simple(fold_complete(events)) == ([("text", prefix)] if prefix else [])


MISSING_END = {  # format -> (suffix removed, call still complete?)
    "hermes": ("</tool_call>", True),
    "qwen3_coder": ("</tool_call>", True),
    "kimi_k2": ("<|tool_calls_section_end|>", True),
    "deepseek_v3": ("<｜tool▁calls▁end｜>", True),
    "deepseek_v31": ("<｜tool▁calls▁end｜>", True),
    "deepseek_v32": ("</｜DSML｜function_calls>", True),
    "minimax_m2": ("</minimax:tool_call>", True),
    "glm47": ("</tool_call>", False),  # no function close tag: another argument could still follow
    "openai": ("<|call|>", True),
    "pythonic": ("]", True),
}


@pytest.mark.parametrize("tools", sorted(MISSING_END))
def test_missing_end_marker(tools):
    fmt = next(f for f in FORMATS if f.tools == tools)
    segs = [("calls", [WEATHER_CALL])]
    wire = fmt.render(segs[0][1])
    suffix, complete = MISSING_END[tools]
    assert wire.endswith(suffix)
    wire = wire[: -len(suffix)]
    kw = kwargs(fmt, segs)
    want = [("call", *WEATHER_CALL)] if complete else []
    assert simple(fold_complete(parse_complete(wire, **kw))) == want
    assert simple(fold_complete(stream(wire, list(range(1, len(wire))), **kw))) == want


WEATHER_CALL = ("get_weather", {"city": "Paris", "days": 3})
