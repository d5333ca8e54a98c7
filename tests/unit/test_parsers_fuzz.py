"""Fuzz: random mixtures of every format's markup, JSON pieces and prose. No input may raise, and the folded
result must not depend on how the text is split into deltas."""

from __future__ import annotations

import random

import pytest

from parser_cases.wire import FORMATS
from test_parsers_formats import check_events, stream
from serve_app.parsers import fold_complete, parse_complete

PIECES = sorted({m for f in FORMATS for m in f.markers} | {
    "<think>", "</think>", "[THINK]", "[/THINK]", "<tool_call>", "</tool_call>", "<function=f>", "</function>",
    "<parameter=a>", "</parameter>", '{"name": "f", "arguments": ', '{"a": 1}', "}", "{", '"', "\\", "\n", " ",
    "hello", "<", "</", "[", "]", "(", ")", "f(a=1)", '"x"', ",", ":", "null", "<|message|>", "<|call|>",
    "<|end|>", "<|start|>assistant", "<|channel|>analysis", "<|channel|>final", " to=functions.f",
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>", '<invoke name="f">', '<parameter name="a">', "<arg_key>", "</arg_key>", "<arg_value>",
    "</arg_value>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", '<｜DSML｜invoke name="f">',
    '<｜DSML｜parameter name="a" string="false">', "</｜DSML｜parameter>", "é🎉"})


def folded(events) -> list[tuple]:
    return [(type(p).__name__, getattr(p, "text", None), getattr(p, "name", None), getattr(p, "arguments", None))
            for p in fold_complete(events)]


def assert_split_invariant(text: str, cut_lists, kw: dict, context) -> None:
    """No input raises, the events keep their contract, and every split folds to what the whole text gives."""
    events = parse_complete(text, **kw)
    check_events(events)
    want = folded(events)
    for cuts in cut_lists:
        ev = stream(text, cuts, **kw)
        check_events(ev)
        assert folded(ev) == want, (context, text, cuts)


def some_cuts(rng: random.Random, text: str, k: int) -> list[list[int]]:
    """k random cut points (fewer for a short text) and one-character deltas."""
    return [sorted(rng.sample(range(1, len(text)), min(len(text) - 1, k))) if len(text) > 1 else [],
            list(range(1, len(text)))]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 40)))


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.tools for f in FORMATS])
def test_fuzz_never_raises_and_is_split_invariant(fmt):
    rng = random.Random(fmt.tools)
    kw = {"reasoning": fmt.reasoning, "tools": fmt.tools}
    for _ in range(150):
        text = random_text(rng)
        assert_split_invariant(text, some_cuts(rng, text, 5), kw, fmt.tools)


def test_mutated_fixtures_are_split_invariant():
    """Valid fixture wires with random deletions, insertions of markup and truncations: the broken calls degrade
    the same way however the text is split."""
    from parser_cases.cases import all_fixtures
    from test_parsers_formats import kwargs

    fixtures = [f for f in all_fixtures() if "big" not in f[0]]
    rng = random.Random(7)
    for _ in range(400):
        name, fmt, wire, _, segs = rng.choice(fixtures)
        w = wire
        for _ in range(rng.randint(1, 3)):
            p = rng.randrange(len(w) + 1)
            op = rng.random()
            if op < 0.4:
                w = w[:p] + w[p + rng.randint(1, 5):]
            elif op < 0.8:
                w = w[:p] + rng.choice(PIECES) + w[p:]
            else:
                w = w[:p]
        if len(w) < 2:
            continue
        assert_split_invariant(w, some_cuts(rng, w, 6), kwargs(fmt, segs), name)


GEMMA4_PIECES = ["<|tool_call>", "call:f{", "call:", "{", "}", "[", "]", ":", ",", '<|"|>', "<|", '"|>', "a:", "1",
                 "-2.5", "true", "tru", "null", " ", "\n", "<tool_call|>", "<tool_call", "<|channel>", "thought\n",
                 "thou", "<channel|>", "x", "é🎉", '"', "\\"]


def test_gemma4_notation_fuzz():
    """Gemma 4's own argument notation, broken at random: no input raises, every finished call's arguments are a
    JSON object, and the folded result does not depend on the split."""
    rng = random.Random(4)
    for _ in range(300):
        text = ("<|tool_call>call:f{" if rng.random() < 0.5 else "") + "".join(
            rng.choice(GEMMA4_PIECES) for _ in range(rng.randint(1, 30)))
        assert_split_invariant(text, some_cuts(rng, text, 5), {"reasoning": "gemma4", "tools": "gemma4"}, "gemma4")
