"""The shared primitives: marker matching with hold-back, incremental JSON validation, schema typing."""

from __future__ import annotations

import json
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from serve_app.parsers.jsonscan import ERROR, NEED_MORE, JsonScanner, json_string_chunk
from serve_app.parsers.markers import Matcher
from serve_app.parsers.schema import coerce, coerce_marked_json

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=20,
)


def feed_in_pieces(text: str, seed: int) -> tuple[int, int]:
    """Feed `text` in random pieces; return (result, offset of the piece where it ended)."""
    rng = random.Random(seed)
    s = JsonScanner()
    pos = 0
    while pos < len(text):
        step = rng.randint(1, 7)
        piece = text[pos:pos + step]
        r = s.feed(piece)
        if r != NEED_MORE:
            return r, (pos + r if r >= 0 else r)
        pos += step
    return NEED_MORE, pos


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=8), JSON, max_size=5), st.booleans(), st.integers(0, 1000))
def test_scanner_finds_the_end_of_any_object(obj, indent, seed):
    text = json.dumps(obj, indent=2 if indent else None, ensure_ascii=seed % 2 == 0)
    r, end = feed_in_pieces(text + ' trailing "junk"', seed)
    assert r >= 0 and end == len(text)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=8), JSON, min_size=1, max_size=5), st.integers(0, 1000))
def test_scanner_never_completes_a_truncated_object(obj, seed):
    text = json.dumps(obj)
    cut = random.Random(seed).randint(1, len(text) - 1)
    r, _ = feed_in_pieces(text[:cut], seed)
    assert r == NEED_MORE


def test_scanner_rejects_malformed():
    for bad in ('{"a": 1,}', '{"a" 1}', '{"a": tru}', '{"a": [1 2]}', '{a: 1}', '{"a": "x\ny"}', '{"a": 01x}',
                '{"a": "\\q"}', "{]"):
        s = JsonScanner()
        assert s.feed(bad) == ERROR, bad
    for good in ('{"a": 1}', "{}", '{"a": [1, {"b": null}], "c": "\\u00e9\\n"}', '{"n": -1.5e+3}'):
        assert JsonScanner().feed(good) == len(good), good


def test_string_chunks_concatenate_to_the_escaped_whole():
    s = 'a "quoted" \\ back\nslash\t\x01 é 🎉'
    rng = random.Random(1)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(s)), 5))
        pieces = [s[a:b] for a, b in zip([0, *cuts], [*cuts, len(s)])]
        assert json.loads('"' + "".join(json_string_chunk(p) for p in pieces) + '"') == s


def test_matcher_earliest_marker_and_minimal_hold():
    m = Matcher(["<tool_call>", "<think>", "</think>"])
    assert m.search("ab<think>cd</think>", 0) == (2, "<think>")
    assert m.search("ab<think>cd</think>", 3) == (11, "</think>")
    text = "hello <to"
    assert text[m.hold_start(text):] == "<to"
    assert m.hold_start("a < b") == len("a < b")  # "< b" cannot become a marker
    assert "x<"[m.hold_start("x<"):] == "<"  # a lone "<" may still become "</think>"
    assert m.hold_start("<<<<th") == 3  # only the shortest possible prefix is held: "<th"
    assert m.hold_start("plain text") == len("plain text")


def test_coerce_from_schema_types():
    assert coerce("42", frozenset({"integer"})) == "42"
    assert coerce("4.0", frozenset({"integer"})) == "4"
    assert coerce("2.5", frozenset({"number"})) == "2.5"
    assert coerce("TRUE", frozenset({"boolean"})) == "true"
    assert coerce('[1, "a"]', frozenset({"array"})) == '[1, "a"]'
    assert coerce("null", frozenset({"integer", "null"})) == "null"
    assert coerce("oops", frozenset({"integer"})) == '"oops"'
    assert coerce("nan", frozenset({"number"})) == '"nan"'
    # Python's None is null where the schema allows null, and only there
    assert coerce("None", frozenset({"integer", "null"})) == "null"
    assert coerce("None", frozenset({"integer"})) == '"None"'
    # an object written as a JSON string of itself (json.dumps(str(dict))) is the object; a string stays a string
    assert json.loads(coerce('"{\'k\': \'v\', \'n\': 1}"', frozenset({"object"}))) == {"k": "v", "n": 1}
    assert json.loads(coerce('"[1, 2]"', frozenset({"array"}))) == [1, 2]
    assert json.loads(coerce('"plain"', frozenset({"object"}))) == "plain"


def test_dsml_marked_json_follows_a_describing_schema():
    assert coerce_marked_json("42", frozenset()) == "42"  # no schema: the model's string="false" decides
    assert coerce_marked_json("null", frozenset({"string"})) == '"null"'
    assert coerce_marked_json("42", frozenset({"string"})) == '"42"'
    assert coerce_marked_json('"hi"', frozenset({"string"})) == '"hi"'
    assert coerce_marked_json("null", frozenset({"string", "null"})) == "null"
    assert coerce_marked_json("3.5", frozenset({"number"})) == "3.5"
