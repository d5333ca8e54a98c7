"""Reasoning split per format, think/call interleaving, Harmony specifics and the public registry metadata."""

from __future__ import annotations

import json
import random

import pytest

from serve_app.conversation import ReasoningDelta, TextDelta, ToolCallStart
from serve_app.parsers import (REASONING_PARSERS, TOOL_PARSERS, fold_complete, make_stream_parser,
                               needs_special_tokens, parse_complete)
from test_parsers_formats import check_events, simple, stream

# formats that split reasoning off by think markers (not Harmony; not the ones that leave the block in the text)
THINK_FORMATS = sorted(n for n, f in REASONING_PARSERS.items() if not f.harmony and not f.as_content)


def cases_for(name):
    f = REASONING_PARSERS[name]
    s, e = f.start, f.end
    return [  # (text, starts_in_reasoning, expected)
        (f"{s}Let me think: a < b.{e}The answer.", False,
         [("reasoning", "Let me think: a < b."), ("text", "The answer.")]),
        (f"Plan: x<y, {e[:-1]} is not the end.{e}Done <3", True,
         [("reasoning", f"Plan: x<y, {e[:-1]} is not the end."), ("text", "Done <3")]),
        (f"{s}echoed start{e}ok", True, [("reasoning", "echoed start"), ("text", "ok")]),
        (f"{s}cut off by the end of the stream <", False, [("reasoning", "cut off by the end of the stream <")]),
        ("No thinking here, just text with < and >.", False,
         [("text", "No thinking here, just text with < and >.")]),
        (f"{s}one{e}mid{s}two{e}end", False,
         [("reasoning", "one"), ("text", "mid"), ("reasoning", "two"), ("text", "end")]),
        (f"{s}{e}only text", False, [("text", "only text")]),
    ]


@pytest.mark.parametrize("name", THINK_FORMATS)
def test_reasoning_table_and_splits(name):
    f = REASONING_PARSERS[name]
    for text, sir, want in cases_for(name):
        kw = {"reasoning": name, "starts_in_reasoning": sir}
        events = parse_complete(text, **kw)
        check_events(events, markers=(f.start, f.end))
        assert simple(fold_complete(events)) == want, text
        rng = random.Random(text)
        for _ in range(100):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
            assert simple(fold_complete(stream(text, cuts, **kw))) == want
        assert simple(fold_complete(stream(text, list(range(1, len(text))), **kw))) == want


def test_format_default_for_starts_in_reasoning():
    assert REASONING_PARSERS["deepseek_r1"].starts_in_reasoning
    assert not REASONING_PARSERS["qwen3"].starts_in_reasoning
    text = "hidden</think>shown"
    assert simple(fold_complete(parse_complete(text, reasoning="deepseek_r1"))) == [
        ("reasoning", "hidden"), ("text", "shown")]
    # the ingress overrides the default when thinking is off: then nothing is reasoning
    assert simple(fold_complete(parse_complete("shown", reasoning="deepseek_r1", starts_in_reasoning=False))) == [
        ("text", "shown")]


def test_registry_metadata():
    assert REASONING_PARSERS["qwen3"].start == "<think>" and REASONING_PARSERS["qwen3"].end == "</think>"
    assert REASONING_PARSERS["mistral"].start == "[THINK]"
    assert needs_special_tokens("gpt_oss", "openai")
    assert needs_special_tokens(None, "kimi_k2")
    assert not needs_special_tokens("qwen3", "qwen3_coder")
    assert not needs_special_tokens(None, None)
    for name in ("hermes", "qwen3_json", "qwen3_coder", "qwen3_xml", "nemotron_nano", "llama3_json", "mistral",
                 "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "kimi_k2", "glm45", "glm47",
                 "minimax_m2", "openai", "pythonic"):
        assert name in TOOL_PARSERS
    for name in ("qwen3", "deepseek_r1", "nemotron_deci", "nemotron_v3", "glm45", "kimi_k2", "kimi_k25",
                 "minimax_m2", "step3", "mistral", "gpt_oss"):
        assert name in REASONING_PARSERS
    with pytest.raises(KeyError):
        make_stream_parser(tools="no_such_format")


QWEN_SCHEMA = [{"type": "function", "function": {"name": "run", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}}}}}]


def test_tool_call_inside_think_is_a_call_qwen35():
    """vllm#39056: Qwen3.5 emits <tool_call> inside <think>; it must still be a call, order kept."""
    text = ("<think>I should list files.\n<tool_call>\n<function=run>\n<parameter=cmd>\nls -la\n</parameter>\n"
            "<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>\nthen read.</think>Listing.")
    kw = {"reasoning": "qwen3", "tools": "qwen3_coder", "tool_schemas": QWEN_SCHEMA}
    want = [("reasoning", "I should list files.\n"), ("call", "run", {"cmd": "ls -la", "timeout": 30}),
            ("reasoning", "\nthen read."), ("text", "Listing.")]
    assert simple(fold_complete(parse_complete(text, **kw))) == want
    assert simple(fold_complete(stream(text, list(range(1, len(text))), **kw))) == want


def test_tool_section_ends_reasoning_kimi_k25():
    text = ("thinking<|tool_calls_section_begin|><|tool_call_begin|>functions.get:0<|tool_call_argument_begin|>"
            '{"k": 1}<|tool_call_end|><|tool_calls_section_end|>after')
    events = parse_complete(text, reasoning="kimi_k25", tools="kimi_k2")
    assert simple(fold_complete(events)) == [("reasoning", "thinking"), ("call", "get", {"k": 1}), ("text", "after")]
    start = next(e for e in events if isinstance(e, ToolCallStart))
    assert start.id == "functions.get:0"  # Kimi's own id is kept: its template renders it back


def test_python_none_is_null_for_a_nullable_parameter():
    """Qwen3.5's template renders a null argument as `None`, so the model writes it: null where null is allowed."""
    schema = [{"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "t": {"type": "string"}}}}]
    text = ("<tool_call>\n<function=f>\n<parameter=s>None</parameter>\n<parameter=n>None</parameter>\n"
            "<parameter=t>None</parameter>\n</function>\n</tool_call>")
    kw = {"tools": "qwen3_coder", "tool_schemas": schema}
    want = [("call", "f", {"s": None, "n": None, "t": "None"})]
    assert simple(fold_complete(parse_complete(text, **kw))) == want
    assert simple(fold_complete(stream(text, list(range(1, len(text))), **kw))) == want


def test_tool_section_ends_reasoning_kimi_k25_without_tool_parser():
    """As for kimi_k2: the section marker ends reasoning and, with no tool parser, stays text."""
    section = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.read:0<|tool_call_argument_begin|>{}"
               "<|tool_call_end|><|tool_calls_section_end|>")
    text = "<think>I should read" + section
    want = [("reasoning", "I should read"), ("text", section)]
    assert simple(fold_complete(parse_complete(text, reasoning="kimi_k25"))) == want
    assert simple(fold_complete(stream(text, list(range(1, len(text))), reasoning="kimi_k25"))) == want


def test_kimi_duplicate_model_ids_get_unique_ids():
    one = ('<|tool_call_begin|>functions.get:0<|tool_call_argument_begin|>{}<|tool_call_end|>')
    text = f"<|tool_calls_section_begin|>{one}{one}<|tool_calls_section_end|>"
    ids = [e.id for e in parse_complete(text, tools="kimi_k2") if isinstance(e, ToolCallStart)]
    assert len(ids) == 2 and len(set(ids)) == 2


def test_ids_unique_across_many_calls():
    text = "".join(f'<tool_call>{{"name": "f", "arguments": {{"i": {i}}}}}</tool_call>' for i in range(200))
    starts = [e for e in parse_complete(text, tools="hermes") if isinstance(e, ToolCallStart)]
    assert [s.index for s in starts] == list(range(200))
    assert len({s.id for s in starts}) == 200 and all(s.id.startswith("call_") for s in starts)


def test_harmony_preamble_and_recipient_before_channel():
    text = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Let me look.<|end|><|start|>assistant to=functions.read<|channel|>commentary json<|message|>"
            '{"path": "a"}<|call|>')
    want = [("reasoning", "think"), ("text", "Let me look."), ("call", "read", {"path": "a"})]
    assert simple(fold_complete(parse_complete(text, reasoning="gpt_oss", tools="openai"))) == want
    assert simple(fold_complete(stream(text, list(range(1, len(text))), reasoning="gpt_oss",
                                       tools="openai"))) == want


def test_harmony_reasoning_without_tool_parser_keeps_calls_out_of_text():
    text = "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>hi<|return|>"
    assert simple(fold_complete(parse_complete(text, reasoning="gpt_oss"))) == [("reasoning", "hmm"), ("text", "hi")]


def test_pythonic_list_that_is_not_calls_is_text():
    assert simple(fold_complete(parse_complete("  [1, 2, 3] are numbers", tools="pythonic"))) == [
        ("text", "  [1, 2, 3] are numbers")]
    assert simple(fold_complete(parse_complete("Text first [f(a=1)]", tools="pythonic"))) == [
        ("text", "Text first [f(a=1)]")]


def test_llama3_bare_json_call_and_plain_brace_text():
    text = '{"name": "get", "parameters": {"q": "x"}}'
    assert simple(fold_complete(parse_complete(text, tools="llama3_json"))) == [("call", "get", {"q": "x"})]
    assert simple(fold_complete(parse_complete("{not json} ok", tools="llama3_json"))) == [
        ("text", "{not json} ok")]


def test_hermes_arguments_first_and_string_arguments():
    a = '<tool_call>{"arguments": {"x": [1, {"y": null}]}, "name": "f"}</tool_call>'
    b = '<tool_call>{"name": "g", "arguments": "{\\"x\\": 2}"}</tool_call>'
    for text, want in ((a, ("call", "f", {"x": [1, {"y": None}]})), (b, ("call", "g", {"x": 2}))):
        assert simple(fold_complete(parse_complete(text, tools="hermes"))) == [want]
        assert simple(fold_complete(stream(text, list(range(1, len(text))), tools="hermes"))) == [want]


def test_xml_values_typed_from_schema_and_strings_streamed():
    schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "number"}, "ok": {"type": "boolean"}, "obj": {"type": "object"}, "s": {"type": "string"},
        "maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "bad": {"type": "integer"}}}}}]
    text = ("<tool_call>\n<function=f>\n<parameter=n>\n2.5\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n"
            '<parameter=obj>\n{"a": [1]}\n</parameter>\n<parameter=s>\n42\n</parameter>\n'
            "<parameter=maybe>\nnull\n</parameter>\n<parameter=bad>\nnot a number\n</parameter>\n"
            "<parameter=extra>\nfree text\n</parameter>\n</function>\n</tool_call>")
    events = parse_complete(text, tools="qwen3_coder", tool_schemas=schema)
    (call,) = [p for p in simple(fold_complete(events))]
    assert call == ("call", "f", {"n": 2.5, "ok": True, "obj": {"a": [1]}, "s": "42", "maybe": None,
                                  "bad": "not a number", "extra": "free text"})
    # a string value is opened before its close tag arrives: streamed, not buffered
    p = make_stream_parser(tools="qwen3_coder", tool_schemas=schema)
    out = p.push("<tool_call>\n<function=f>\n<parameter=s>\nhello wor")
    assert "".join(e.arguments for e in out if hasattr(e, "arguments")) == '{"s": "hello wor'


def test_dsml_string_attribute_decides_typing():
    d = "｜DSML｜"
    text = (f'<{d}function_calls><{d}invoke name="f"><{d}parameter name="a" string="true">5</{d}parameter>'
            f'<{d}parameter name="b" string="false">5</{d}parameter><{d}parameter name="c" string="false">x y'
            f"</{d}parameter></{d}invoke></{d}function_calls>")
    assert simple(fold_complete(parse_complete(text, tools="deepseek_v32"))) == [
        ("call", "f", {"a": "5", "b": 5, "c": "x y"})]


def test_hold_back_is_bounded_and_released():
    """Only a marker-sized suffix is ever held: text streams out as it arrives."""
    p = make_stream_parser(reasoning="qwen3", tools="hermes")
    out = p.push("<think>" + "a" * 10_000 + "</thi")
    assert sum(len(e.text) for e in out if isinstance(e, ReasoningDelta)) == 10_000
    out = p.push("nk>text <tool_")
    assert [e.text for e in out if isinstance(e, TextDelta)] == ["text "]
    out = p.push("x")  # "<tool_x" cannot be a marker any more: released at once
    assert "".join(e.text for e in out if isinstance(e, TextDelta)) == "<tool_x"
    assert [e.text for e in p.push("<") + p.finish()] == ["<"]


def test_token_ids_are_accepted():
    p = make_stream_parser(reasoning="qwen3", tools="hermes")
    assert simple(fold_complete(p.push("hi", token_ids=[1, 2]) + p.finish())) == [("text", "hi")]


def test_schemas_accepted_in_every_shape():
    from serve_app.conversation import ToolSpec

    props = {"type": "object", "properties": {"n": {"type": "integer"}}}
    text = "<tool_call>\n<function=f>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>"
    for schemas in ([{"type": "function", "function": {"name": "f", "parameters": props}}],
                    [{"name": "f", "input_schema": props}], [ToolSpec(name="f", parameters=props)]):
        assert simple(fold_complete(parse_complete(text, tools="qwen3_coder", tool_schemas=schemas))) == [
            ("call", "f", {"n": 7})]
    # a value no schema describes is decoded as JSON when it parses (vLLM's rule), else kept as the string it is
    assert simple(fold_complete(parse_complete(text, tools="qwen3_coder"))) == [("call", "f", {"n": 7})]
    loose = text.replace("\n7\n", "\nseven\n")
    assert simple(fold_complete(parse_complete(loose, tools="qwen3_coder"))) == [("call", "f", {"n": "seven"})]


def test_whitespace_between_calls_is_not_text_but_real_text_keeps_its_spacing():
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    text = f"Checking.\n{call}\n{call}\n\n"
    want = [("text", "Checking.\n"), ("call", "f", {}), ("call", "f", {})]
    assert simple(fold_complete(parse_complete(text, tools="hermes"))) == want
    assert simple(fold_complete(stream(text, list(range(1, len(text))), tools="hermes"))) == want
    text2 = f"{call}\n\nDone."
    assert simple(fold_complete(parse_complete(text2, tools="hermes"))) == [("call", "f", {}), ("text", "\n\nDone.")]


def test_markup_inside_json_strings_is_content():
    """The JSON scanner, not a marker search, decides where hermes arguments end."""
    args = {"content": "x = '</tool_call>' + \"<tool_call>\" # </think>", "n": [1, "}"]}
    text = '<tool_call>{"name": "write", "arguments": ' + json.dumps(args) + "}</tool_call>tail"
    want = [("call", "write", args), ("text", "tail")]
    for cuts in ([], list(range(1, len(text)))):
        assert simple(fold_complete(stream(text, cuts, reasoning="qwen3", tools="hermes"))) == want


def test_no_parsers_is_plain_text_passthrough():
    p = make_stream_parser()
    assert [e.text for e in p.push("hello <think> <tool_call>") + p.finish()] == ["hello <think> <tool_call>"]


# Formats of other families: (text, parser kwargs, expected). Each is also checked in 100 random splits and in
# one-character deltas.
OTHER_FAMILIES = {
    "hunyuan_think_then_answer": (
        "<think>\nstep 1\nstep 2\n</think>\n<answer>\nThe answer.\n</answer>", {"reasoning": "hunyuan_a13b"},
        [("reasoning", "step 1\nstep 2"), ("text", "The answer.")]),
    "hunyuan_quick_thought": ("<think>\n\n</think>\n<answer>\nHi\n</answer>", {"reasoning": "hunyuan_a13b"},
                              [("text", "Hi")]),
    "hunyuan_answer_tag_inside_think_is_reasoning": (
        "<think>\nuse <answer>\n tags\n</think>\n<answer>\nok\n</answer>", {"reasoning": "hunyuan_a13b"},
        [("reasoning", "use <answer>\n tags"), ("text", "ok")]),
    "hunyuan_second_turn_of_thinking": (
        "<think>\na\n</think>\n<answer>\nb\n</answer><think>\nc\n</think>\n<answer>\nd\n</answer>",
        {"reasoning": "hunyuan_a13b"}, [("reasoning", "a"), ("text", "b"), ("reasoning", "c"), ("text", "d")]),
    "ernie_response_tags_and_padding": (
        "abc\n</think>\n\n<response>\ndef\n</response>\n", {"reasoning": "ernie45"},
        [("reasoning", "abc"), ("text", "def")]),
    "ernie_plain_answer": ("abc\n</think>\ndef\nghi\n", {"reasoning": "ernie45"},
                           [("reasoning", "abc"), ("text", "def\nghi\n")]),
    "ernie_newlines_inside_answer_kept": (
        "<think>x</think><response>\n\nline 1\n\nline 2\n\n</response>", {"reasoning": "ernie45"},
        [("reasoning", "x"), ("text", "\nline 1\n\nline 2\n")]),
    "granite_both_spellings": (
        "Here's my thought process: foo Here is my response: bar", {"reasoning": "granite"},
        [("reasoning", " foo "), ("text", " bar")]),
    "granite_headers_broken_off_are_text": (
        "Here is my thought: no. Here is", {"reasoning": "granite"}, [("text", "Here is my thought: no. Here is")]),
    "granite_thinking_cut_off": ("Here is my thought process: Here was", {"reasoning": "granite"},
                                 [("reasoning", " Here was")]),
    "hy_v3_effort_high_opens_the_block": ("plan</think>answer", {"reasoning": "hy_v3", "starts_in_reasoning": True},
                                          [("reasoning", "plan"), ("text", "answer")]),
    "hy_v3_no_think_is_text": ("answer", {"reasoning": "hy_v3"}, [("text", "answer")]),
    "holo2_thinks_by_default": ("plan</think>answer", {"reasoning": "holo2"},
                                [("reasoning", "plan"), ("text", "answer")]),
    "holo2_thinking_off": ("answer", {"reasoning": "holo2", "starts_in_reasoning": False}, [("text", "answer")]),
    "minimax_append_think_keeps_the_block": (
        "plan</think>answer", {"reasoning": "minimax_m2_append_think"}, [("text", "<think>plan</think>answer")]),
    "minimax_append_think_model_opened_it": (
        "<think>plan</think>answer", {"reasoning": "minimax_m2_append_think", "starts_in_reasoning": False},
        [("text", "<think>plan</think>answer")]),
    "minimax_append_think_with_calls": (
        'plan</think><minimax:tool_call>\n<invoke name="f">\n<parameter name="a">1</parameter>\n</invoke>\n'
        "</minimax:tool_call>", {"reasoning": "minimax_m2_append_think", "tools": "minimax_m2"},
        [("text", "<think>plan</think>"), ("call", "f", {"a": "1"})]),
}


@pytest.mark.parametrize("case", sorted(OTHER_FAMILIES))
def test_other_family_formats_and_splits(case):
    text, kw, want = OTHER_FAMILIES[case]
    events = parse_complete(text, **kw)
    check_events(events)
    assert simple(fold_complete(events)) == want
    rng = random.Random(case)
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        assert simple(fold_complete(stream(text, cuts, **kw))) == want, cuts
    assert simple(fold_complete(stream(text, list(range(1, len(text))), **kw))) == want


def test_append_think_empty_output_is_empty():
    """The start marker is put back with the first text the model writes: an empty output stays empty."""
    p = make_stream_parser(reasoning="minimax_m2_append_think")
    assert p.push("") + p.finish() == []
