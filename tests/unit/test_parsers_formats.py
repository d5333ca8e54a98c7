"""Fixture table per format plus the split-invariance properties (vLLM's test_streaming_split_invariance, applied
to every fixture): 100 seeded random splits and one-character deltas fold to exactly what parse_complete gives."""

from __future__ import annotations

import json
import random

import pytest

from parser_cases.cases import BIG, all_fixtures
from parser_cases.wire import FORMATS, MINIMAX_M3_CASES, MM3, schemas_for
from serve_app.conversation import (ReasoningPart, TextPart, ToolCallArgsDelta, ToolCallEnd, ToolCallPart,
                                    ToolCallStart)
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
        if fmt.tools in ("pythonic", "llama4_pythonic", "olmo3", "minimax_m3"):
            continue  # pythonic calls are emitted whole at their closing parenthesis, MiniMax-M3's at </invoke>
        segs = [("calls", [("write_file", {"path": "a", "content": BIG})])]
        wire = fmt.render(segs[0][1])
        p = make_stream_parser(**kwargs(fmt, segs))
        frags_before_end = 0
        for k in range(0, len(wire), 16):
            for e in p.push(wire[k:k + 16]):
                frags_before_end += isinstance(e, ToolCallArgsDelta)
        assert frags_before_end > 500, fmt.tools


# -- malformed, truncated, missing end markers --------------------------------------------------------------------

MALFORMED = {  # format -> (wire, expected fold): degrade to text before the call commits (Harmony: skipped)
    "hermes": ("Sure. <tool_call>this is not json</tool_call>", [("text", "Sure. <tool_call>this is not json</tool_call>")]),
    "qwen3_coder": ("Sure. <tool_call>\nnot xml\n</tool_call>", [("text", "Sure. <tool_call>\nnot xml\n</tool_call>")]),
    "llama3_json": ("<|python_tag|>not json", [("text", "<|python_tag|>not json")]),
    "mistral": ("[TOOL_CALLS]not a call", [("text", "[TOOL_CALLS]not a call")]),
    "deepseek_v3": ("x<｜tool▁calls▁begin｜>junk<｜tool▁calls▁end｜>", [("text", "x<｜tool▁calls▁begin｜>junk<｜tool▁calls▁end｜>")]),
    "kimi_k2": ("<|tool_calls_section_begin|>junk<|tool_calls_section_end|>", [("text", "<|tool_calls_section_begin|>junk<|tool_calls_section_end|>")]),
    "deepseek_v32": ("<｜DSML｜function_calls>junk</｜DSML｜function_calls>", [("text", "<｜DSML｜function_calls>junk</｜DSML｜function_calls>")]),
    "glm47": ("<tool_call>not a name</tool_call>", [("text", "<tool_call>not a name</tool_call>")]),
    "minimax_m2": ("<minimax:tool_call>junk</minimax:tool_call>", [("text", "<minimax:tool_call>junk</minimax:tool_call>")]),
    "minimax_m3": (f"{MM3}<tool_call>junk{MM3}</tool_call>", [("text", f"{MM3}<tool_call>junk{MM3}</tool_call>")]),
    "pythonic": ("[not a call] ok", [("text", "[not a call] ok")]),
    "gemma4": ("So <|tool_call>not a call<tool_call|>", [("text", "So <|tool_call>not a call<tool_call|>")]),
    "llama4_pythonic": ("<|python_start|>[1, 2]<|python_end|> ok",
                        [("text", "<|python_start|>[1, 2]<|python_end|> ok")]),
    "phi4_mini_json": ("Use functools.partial here.", [("text", "Use functools.partial here.")]),
    "olmo3": ("Sure. <function_calls>not a call</function_calls>",
              [("text", "Sure. <function_calls>not a call</function_calls>")]),
    "minimax": ("<tool_calls>junk</tool_calls>", [("text", "<tool_calls>junk</tool_calls>")]),
    "hunyuan_a13b": ("<tool_calls>[junk]</tool_calls>", [("text", "<tool_calls>[junk]</tool_calls>")]),
    "granite": ("<|tool_call|>[1, 2]", [("text", "<|tool_call|>[1, 2]")]),
    "gigachat3": ("<|function_call|>not json", [("text", "<|function_call|>not json")]),
    # a call body that is not JSON: abandoned and skipped, its markup never shown (then the final answer)
    "openai": ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>oops<|call|>"
               "<|start|>assistant<|channel|>final<|message|>ok<|return|>", [("text", "ok")]),
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
    "gemma4": '<|tool_call>call:f{a:1,b]}<tool_call|>',
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
# Harmony's markup is special tokens: a cut-off call there is only dropped. The other formats give the cut-off
# call's raw text back as text, so the non-streaming answer loses nothing.
DROPS_CUT_OFF_TEXT = {"openai"}


@pytest.mark.parametrize("fmt", TRUNCATED_FORMATS, ids=[f.tools for f in TRUNCATED_FORMATS])
def test_call_cut_off_by_end_of_stream_is_abandoned_and_its_text_kept(fmt):
    segs = [("calls", [("write_file", {"path": "a.py", "content": "print('hello world, this is long')"})])]
    wire = fmt.render(segs[0][1])
    cut = wire.index("hello world") + 5
    prefix = "Before. " if fmt.text_before_calls else ""
    text = prefix + wire[:cut]
    kw = kwargs(fmt, segs)
    want = [("text", prefix)] if fmt.tools in DROPS_CUT_OFF_TEXT else [("text", text)]
    for cuts in ([], list(range(1, len(text)))):
        events = stream(text, cuts, **kw)
        check_events(events, markers=fmt.markers if fmt.tools in DROPS_CUT_OFF_TEXT else ())
        assert not any(isinstance(e, ToolCallEnd) for e in events)
        assert simple(fold_complete(events)) == ([w for w in want if w[1]])


MISSING_END = {  # format -> (suffix removed, call still complete?)
    "hermes": ("</tool_call>", True),
    "qwen3_coder": ("</tool_call>", True),
    "kimi_k2": ("<|tool_calls_section_end|>", True),
    "deepseek_v3": ("<｜tool▁calls▁end｜>", True),
    "deepseek_v31": ("<｜tool▁calls▁end｜>", True),
    "deepseek_v32": ("</｜DSML｜function_calls>", True),
    "minimax_m2": ("</minimax:tool_call>", True),
    "minimax_m3": (f"{MM3}</tool_call>", True),
    "glm47": ("</tool_call>", False),  # no function close tag: another argument could still follow (kept as text)
    "openai": ("<|call|>", True),
    "pythonic": ("]", True),
    "gemma4": ("<tool_call|>", True),  # the arguments' closing `}` completes the call
    "llama4_pythonic": ("]<|python_end|>", True),
    "olmo3": ("</function_calls>", True),
    "phi4_mini_json": ("]", True),
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
    want = [("call", *WEATHER_CALL)] if complete else [("text", wire)]
    assert simple(fold_complete(parse_complete(wire, **kw))) == want
    assert simple(fold_complete(stream(wire, list(range(1, len(wire))), **kw))) == want


WEATHER_CALL = ("get_weather", {"city": "Paris", "days": 3})


# -- cases found by vLLM's parser tables (tests/data/vllm_parser_tables, docs/parser-conformance.md) ------------------

_K = "<|tool_calls_section_begin|>{}<|tool_calls_section_end|>"
_KC = "<|tool_call_begin|>{} <|tool_call_argument_begin|>{}<|tool_call_end|>"
_HC = "<|start|>assistant<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"
_DS = '<｜DSML｜{0}><｜DSML｜invoke name="get_weather">{1}</｜DSML｜invoke></｜DSML｜{0}>'
_DP = '<｜DSML｜parameter name="{}" string="{}">{}</｜DSML｜parameter>'
_NULLABLE = [{"type": "function", "function": {"name": "update_profile", "parameters": {
    "type": "object", "properties": {"nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}}]
_MM = ('<minimax:tool_call><invoke name="update_profile"><parameter name="nickname">{}</parameter></invoke>'
       "</minimax:tool_call>")

REPORTED = {  # id -> (text, parser kwargs, expected fold)
    # kimi_k2: a malformed call inside a section is skipped; the valid call after it stands, no markup leaks
    "kimi_bad_json_then_good": (
        "Help. " + _K.format(_KC.format("functions.bad:0", '{"city": "Beijing"')
                             + _KC.format("functions.good:1", '{"city": "Shanghai"}')),
        {"tools": "kimi_k2"}, [("text", "Help. "), ("call", "good", {"city": "Shanghai"})]),
    # where a malformed call's skip ends does not depend on where the deltas split (the marker inside its string)
    "section_skip_is_split_invariant": (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>r<｜tool▁sep｜>{"<｜tool▁call▁end｜>"<', {"tools": "deepseek_v31"},
        [("text", '"<')]),
    "kimi_head_without_index_is_not_a_call": (
        _K.format(_KC.format("functions.invalid.0", '{"a": 1}') + _KC.format("functions.valid:1", '{"a": 2}')),
        {"tools": "kimi_k2"}, [("call", "valid", {"a": 2})]),
    # Harmony: a body that is not JSON is an abandoned call (no markup in the text); an empty body has no arguments
    "harmony_non_json_body": (
        "<|channel|>analysis<|message|>plan<|end|>" + _HC.format("a", "foo") + _HC.format("b", '{"x": 1}'),
        {"reasoning": "gpt_oss", "tools": "openai"}, [("reasoning", "plan"), ("call", "b", {"x": 1})]),
    "harmony_empty_body": (_HC.format("no_args", ""), {"reasoning": "gpt_oss", "tools": "openai"},
                           [("call", "no_args", {})]),
    "harmony_to_assistant_is_not_content": (
        "<|channel|>commentary to=assistant<|message|>Some tool response<|call|>"
        "<|start|>assistant<|channel|>final<|message|>Here is the answer<|end|>",
        {"reasoning": "gpt_oss", "tools": "openai"}, [("text", "Here is the answer")]),
    # mistral v11: NAME{..} ([ARGS] decoded away) and NAME[CALL_ID]ID[ARGS]{..}
    "mistral_v11_without_args_marker": ('bla[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]mul{"a": 3}', {
        "tools": "mistral"}, [("text", "bla"), ("call", "add", {"a": 3.5, "b": 4}), ("call", "mul", {"a": 3})]),
    "mistral_call_id": ('[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 1}', {"tools": "mistral"},
                        [("call", "add", {"a": 1})]),
    # the whitespace after a call whose wrapper does not close is text, however the deltas are split
    "whitespace_after_unclosed_wrapper": ('[TOOL_CALLS][{"name": "f", "arguments": {}}  oops', {"tools": "mistral"},
                                          [("call", "f", {}), ("text", "  oops")]),
    "mistral_whitespace_after_abandoned_call": ("Sure.[TOOL_CALLS]  hello world", {"tools": "mistral"},
                                                [("text", "Sure.[TOOL_CALLS]  hello world")]),
    "llama3_whitespace_after_unclosed_wrapper": ('{"name":"f","arguments":{} >', {"tools": "llama3_json"},
                                                 [("call", "f", {}), ("text", " >")]),
    # minimax_m2: null for an anyOf [string, null] parameter is null; other text stays a string
    "minimax_nullable_null": (_MM.format("null"), {"tools": "minimax_m2", "tool_schemas": _NULLABLE},
                              [("call", "update_profile", {"nickname": None})]),
    "minimax_nullable_prefix_of_null": (_MM.format("nul"), {"tools": "minimax_m2", "tool_schemas": _NULLABLE},
                                        [("call", "update_profile", {"nickname": "nul"})]),
    "minimax_nullable_string": (_MM.format("Alice"), {"tools": "minimax_m2", "tool_schemas": _NULLABLE},
                                [("call", "update_profile", {"nickname": "Alice"})]),
    # minimax_m2: a value no schema describes is a string (MiniMax's rule), however much it looks like JSON
    "minimax_undescribed_is_string": (_MM.format("5") + _MM.format('{"a": 1}'), {"tools": "minimax_m2"},
                                      [("call", "update_profile", {"nickname": "5"}),
                                       ("call", "update_profile", {"nickname": '{"a": 1}'})]),
    # glm45: a call cut off before </tool_call> keeps its text in the non-streaming answer
    "glm45_cut_off": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>",
                      {"tools": "glm45"},
                      [("text", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>")]),
    # llama3_json: a call after prose; a name without arguments is not a call
    "llama3_after_prose": ('Here: {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
                           {"tools": "llama3_json"}, [("text", "Here: "), ("call", "f", {"a": 1}), ("call", "g", {})]),
    "llama3_name_only": ('{"name": "toolWithoutParams"}', {"tools": "llama3_json"},
                         [("text", '{"name": "toolWithoutParams"}')]),
    # deepseek_v32/v4: a lone `arguments` (or `input`) wrapper parameter is the arguments object
    "dsml_v32_arguments_wrapper": (_DS.format("function_calls", _DP.format("arguments", "false", '{"city": "Paris"}')),
                                   {"tools": "deepseek_v32"}, [("call", "get_weather", {"city": "Paris"})]),
    "dsml_v4_input_wrapper": (_DS.format("tool_calls", _DP.format("input", "true", '{"city": "Paris"}')),
                              {"tools": "deepseek_v4"}, [("call", "get_weather", {"city": "Paris"})]),
    "dsml_wrapper_with_a_second_parameter_stays": (
        _DS.format("tool_calls", _DP.format("arguments", "false", '{"c": 1}') + _DP.format("n", "false", "2")),
        {"tools": "deepseek_v4"}, [("call", "get_weather", {"arguments": {"c": 1}, "n": 2})]),
    "dsml_declared_arguments_parameter_stays": (
        _DS.format("tool_calls", _DP.format("arguments", "false", '{"c": 1}')),
        {"tools": "deepseek_v4", "tool_schemas": [{"name": "get_weather", "parameters": {
            "type": "object", "properties": {"arguments": {"type": "object"}}}}]},
        [("call", "get_weather", {"arguments": {"c": 1}})]),
    # qwen3 without a tool parser: the tool-call marker ends reasoning and stays text (vLLM's reasoning parser)
    "qwen3_reasoning_only_tool_call_ends_reasoning": (
        "I need to read.\n\n<tool_call>\n<function=bash>", {"reasoning": "qwen3", "starts_in_reasoning": True},
        [("reasoning", "I need to read.\n\n"), ("text", "<tool_call>\n<function=bash>")]),
    "kimi_reasoning_only_section_ends_reasoning": (
        "some reasoning<|tool_calls_section_begin|>data", {"reasoning": "kimi_k2", "starts_in_reasoning": True},
        [("reasoning", "some reasoning"), ("text", "<|tool_calls_section_begin|>data")]),
    # qwen3_coder: a <function=...> without <tool_call>; a Python-literal object for an object parameter
    "qwen3_coder_bare_function": ("<function=get_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>",
                                  {"tools": "qwen3_coder"}, [("call", "get_weather", {"city": "Dallas"})]),
    "qwen3_coder_python_literal_object": (
        "<tool_call>\n<function=f>\n<parameter=obj>\n{'key': 'value'}\n</parameter>\n</function>\n</tool_call>",
        {"tools": "qwen3_coder", "tool_schemas": [{"name": "f", "parameters": {
            "type": "object", "properties": {"obj": {"type": "object"}}}}]}, [("call", "f", {"obj": {"key": "value"}})]),
    # whitespace that only opens the output before a call, or before a repeated think marker, is not content
    "glm47_leading_whitespace_before_call": ("  \n  <tool_call>get_current_date</tool_call>", {"tools": "glm47"},
                                             [("call", "get_current_date", {})]),
    "r1_newline_before_repeated_think": ("\n<think>r</think>x", {"reasoning": "deepseek_r1",
                                                                 "starts_in_reasoning": True},
                                         [("reasoning", "r"), ("text", "x")]),
    # harmony: the generation prompt ends with `<|start|>assistant`, so the first message's header goes on from
    # there (recipient before the channel); output that does not start like a header is text, and a header the
    # end cut off comes back as text
    "harmony_first_header_recipient_before_channel": (
        " to=functions.refresh<|channel|>commentary json<|message|>{}<|call|>", {"reasoning": "gpt_oss",
                                                                                   "tools": "openai"},
        [("call", "refresh", {})]),
    "harmony_first_header_channel": ("<|channel|>analysis<|message|>r<|end|><|start|>assistant<|channel|>final"
                                     "<|message|>x", {"reasoning": "gpt_oss", "tools": "openai"},
                                     [("reasoning", "r"), ("text", "x")]),
    "harmony_plain_output_is_text": ("tomorrow", {"reasoning": "gpt_oss", "tools": "openai"}, [("text", "tomorrow")]),
    "harmony_cut_header_is_text": (" to=functions.f<|channel|>comm", {"reasoning": "gpt_oss", "tools": "openai"},
                                   [("text", " to=functions.f<|channel|>comm")]),
    # gemma4: the `thought\n` role label after <|channel> is markup; text that only starts like it is reasoning
    "gemma4_thought_label": ("<|channel>thought\nPlan.<channel|>Answer", {"reasoning": "gemma4"},
                             [("reasoning", "Plan."), ("text", "Answer")]),
    "gemma4_label_prefix_is_reasoning": ("<|channel>thousand reasons<channel|>Done", {"reasoning": "gemma4"},
                                         [("reasoning", "thousand reasons"), ("text", "Done")]),
    "gemma4_label_cut_off_is_reasoning": ("<|channel>thou", {"reasoning": "gemma4"}, [("reasoning", "thou")]),
    # gemma4 values: nested, bare literals, null, numbers; a bare word is a string, `key:` an empty string
    "gemma4_values": (
        '<|tool_call>call:f{o:{k:[1,-2.5,true,null,<|"|>a,b}]<|"|>]},w: bare word ,e:,n:1e3}<tool_call|>',
        {"tools": "gemma4"},
        [("call", "f", {"o": {"k": [1, -2.5, True, None, "a,b}]"]}, "w": "bare word", "e": "", "n": 1000.0})]),
    # a call inside the thinking block ends it (vLLM's is_reasoning_end); the whitespace between calls is dropped
    "gemma4_call_ends_reasoning": (
        '<|channel>thought\nneed data<|tool_call>call:a{x:1}<tool_call|>\n<|tool_call>call:b{}<tool_call|>ok',
        {"reasoning": "gemma4", "tools": "gemma4"},
        [("reasoning", "need data"), ("call", "a", {"x": 1}), ("call", "b", {}), ("text", "ok")]),
    # without a tool parser the call marker ends reasoning and stays text
    "gemma4_reasoning_only_call_is_text": ("<|channel>r<|tool_call>call:a{}", {"reasoning": "gemma4"},
                                           [("reasoning", "r"), ("text", "<|tool_call>call:a{}")]),
    # text after a call's `}` that is not its end marker is text; the call stands
    "gemma4_text_after_arguments": ('<|tool_call>call:a{x:<|"|>y<|"|>} then', {"tools": "gemma4"},
                                    [("call", "a", {"x": "y"}), ("text", " then")]),
    # `]` closing an object breaks the notation: abandoned, all its text is text
    "gemma4_mismatched_close": ("<|tool_call>call:a{x:1]}<tool_call|>", {"tools": "gemma4"},
                                [("text", "<|tool_call>call:a{x:1]}<tool_call|>")]),
    # olmo3: calls one per line (or comma-separated) inside <function_calls>, JSON literals read like Python's; the
    # bracketed list is not its format; what follows the calls without the end marker is text
    "olmo3_json_literals": ("<function_calls>f(a=null, b=true, c=[false, {\"k\": null}], d='x')</function_calls>",
                            {"tools": "olmo3"},
                            [("call", "f", {"a": None, "b": True, "c": [False, {"k": None}], "d": "x"})]),
    "olmo3_one_call_per_line": ("Sure. <function_calls>\nf(a=1)\ng(), h()\n</function_calls> Done.", {"tools": "olmo3"},
                                [("text", "Sure. "), ("call", "f", {"a": 1}), ("call", "g", {}), ("call", "h", {}),
                                 ("text", " Done.")]),
    "olmo3_text_after_calls_without_end": ("<function_calls>f()\nThanks", {"tools": "olmo3"},
                                           [("call", "f", {}), ("text", "\nThanks")]),
    "olmo3_bracketed_list_is_text": ("<function_calls>[f(a=1)]</function_calls>", {"tools": "olmo3"},
                                     [("text", "<function_calls>[f(a=1)]</function_calls>")]),
    "olmo3_cut_off_call_is_text": ("<function_calls>f(a=1)\ng(b='x", {"tools": "olmo3"},
                                   [("call", "f", {"a": 1}), ("text", "\ng(b='x")]),
    "pythonic_reads_no_json_literals": ("[f(a=true)]", {"tools": "pythonic"}, [("text", "[f(a=true)]")]),
    "pythonic_cut_off_call_is_text": ("[f(a=1), g(b=", {"tools": "pythonic"},
                                      [("call", "f", {"a": 1}), ("text", ", g(b=")]),
    # phi4_mini_json: the JSON list after `functools` (arguments or parameters); a wrapper without arguments, or an
    # empty list, is not a call
    "phi4_list": ('Checking. functools[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "parameters": {}}] Done.',
                  {"tools": "phi4_mini_json"}, [("text", "Checking. "), ("call", "f", {"a": 1}), ("call", "g", {}),
                                                ("text", " Done.")]),
    "phi4_name_only_is_text": ('functools[{"name": "func"}]', {"tools": "phi4_mini_json"},
                               [("text", 'functools[{"name": "func"}]')]),
    "phi4_empty_list_is_text": ("functools[] This is just text", {"tools": "phi4_mini_json"},
                                [("text", "functools[] This is just text")]),
    # llama4_pythonic: the list with or without <|python_start|>, <|python_end|> consumed after it; a start marker
    # that opens no list is text and the scan goes on after it
    "llama4_start_without_end": ("<|python_start|>[f(a=1), g()]", {"tools": "llama4_pythonic"},
                                 [("call", "f", {"a": 1}), ("call", "g", {})]),
    "llama4_bare_list_with_end": ("[f(a=1)] <|python_end|>Done.", {"tools": "llama4_pythonic"},
                                  [("call", "f", {"a": 1}), ("text", "Done.")]),
    "llama4_after_prose": ("Let me check. <|python_start|>[f()]<|python_end|>", {"tools": "llama4_pythonic"},
                           [("text", "Let me check. "), ("call", "f", {})]),
    "llama4_cut_end_marker_is_text": ("<|python_start|>[f()]<|python_", {"tools": "llama4_pythonic"},
                                      [("call", "f", {}), ("text", "<|python_")]),
    "llama4_marker_without_list_is_text": ("<|python_start|>oops <|python_start|>[f()]", {"tools": "llama4_pythonic"},
                                           [("text", "<|python_start|>oops "), ("call", "f", {})]),
    # MiniMax-M1: a malformed line, a name without arguments, arguments without a name are skipped; the calls
    # around them stand and no markup leaks
    "minimax_m1_bad_lines_skipped": (
        '<tool_calls>\n{"name": "a", "arguments": {"x": 1}}\n{invalid json here}\n{"name": "missing_args"}\n'
        '{"arguments": {"c": 1}}\n{"name": "b", "arguments": {}}\n</tool_calls>', {"tools": "minimax"},
        [("call", "a", {"x": 1}), ("call", "b", {})]),
    "minimax_m1_no_calls_in_think_block": (
        '<think>try <tool_calls>\n{"name": "x", "arguments": {}}\n</tool_calls></think>Ok <tool_calls>\n'
        '{"name": "y", "arguments": {}}\n</tool_calls>', {"tools": "minimax"},
        [("text", '<think>try <tool_calls>\n{"name": "x", "arguments": {}}\n</tool_calls></think>Ok '),
         ("call", "y", {})]),
    "minimax_m1_missing_section_end": ('<tool_calls>\n{"name": "a", "arguments": {"x": 1}}', {"tools": "minimax"},
                                       [("call", "a", {"x": 1})]),
    # Hunyuan-A13B / Jamba: one JSON list inside <tool_calls>; anything but a list there is text
    "hunyuan_list": ('Now. <tool_calls>[{"name": "a", "arguments": {"x": [1, {"y": 2}]}}, {"name": "b", '
                     '"arguments": {}}]</tool_calls>', {"tools": "hunyuan_a13b"},
                     [("text", "Now. "), ("call", "a", {"x": [1, {"y": 2}]}), ("call", "b", {})]),
    "jamba_not_a_list_is_text": ('<tool_calls>{"name": "a", "arguments": {}}</tool_calls>', {"tools": "jamba"},
                                 [("text", '<tool_calls>{"name": "a", "arguments": {}}</tool_calls>')]),
    # Granite 3 / xLAM: a list may open the answer without a marker, but a list after prose is prose
    "granite_bare_list": (' [{"name": "a", "arguments": {"x": 1}}]', {"tools": "granite"}, [("call", "a", {"x": 1})]),
    "granite_list_after_prose_is_text": ('Some text [{"name": "f", "arguments": {}}]', {"tools": "granite"},
                                         [("text", 'Some text [{"name": "f", "arguments": {}}]')]),
    "xlam_list_after_think_block": ('<think>plan</think>[{"name": "a", "arguments": {}}]', {"tools": "xlam"},
                                    [("text", "<think>plan</think>"), ("call", "a", {})]),
    "xlam_no_call_in_think_block": ('<think>[{"name": "a", "arguments": {}}]</think>ok', {"tools": "xlam"},
                                    [("text", '<think>[{"name": "a", "arguments": {}}]</think>ok')]),
    "xlam_json_fence": ('Sure.\n```json\n[{"name": "a", "arguments": {}}]\n```', {"tools": "xlam"},
                        [("text", "Sure.\n"), ("call", "a", {})]),
    "xlam_tool_call_tags_then_text": ('<tool_call>[{"name": "a", "arguments": {}}]</tool_call> done', {"tools": "xlam"},
                                      [("call", "a", {}), ("text", " done")]),
    # GigaChat 3: the end-of-sequence token after the call is not content; without it, what follows is text
    "gigachat3_eos_after_call": ('Ok.<|function_call|>{"name": "a", "arguments": {"x": 1}}</s>', {"tools": "gigachat3"},
                                 [("text", "Ok."), ("call", "a", {"x": 1})]),
    "gigachat3_text_after_call": ('<|function_call|>{"name": "a", "arguments": {}} bye', {"tools": "gigachat3"},
                                  [("call", "a", {}), ("text", " bye")]),
    "gigachat3_cut_eos_is_text": ('<|function_call|>{"name": "a", "arguments": {}}</', {"tools": "gigachat3"},
                                  [("call", "a", {}), ("text", "</")]),
    "internlm2_parameters": ('Sure.<|action_start|><|plugin|>{"name": "a", "parameters": {"x": 1}}<|action_end|>',
                            {"tools": "internlm2"}, [("text", "Sure."), ("call", "a", {"x": 1})]),
    "granite_20b_fc_two_calls": ('<function_call> {"name": "a", "arguments": {}}\n<function_call> {"name": "b", '
                                 '"arguments": {"y": "z"}}', {"tools": "granite-20b-fc"},
                                 [("call", "a", {}), ("call", "b", {"y": "z"})]),
    "hy_v3_typed_value": ("<tool_calls><tool_call>f<tool_sep><arg_key>n</arg_key><arg_value>5</arg_value>"
                          "<arg_key>s</arg_key><arg_value>5</arg_value></tool_call></tool_calls>",
                          {"tools": "hy_v3", "tool_schemas": [{"name": "f", "parameters": {
                              "type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}}]},
                          [("call", "f", {"n": 5, "s": "5"})]),
}


@pytest.mark.parametrize("case", sorted(REPORTED))
def test_reported_case(case):
    text, kw, want = REPORTED[case]
    assert simple(fold_complete(parse_complete(text, **kw))) == want
    rng = random.Random(case)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        assert simple(fold_complete(stream(text, cuts, **kw))) == want, cuts
    assert simple(fold_complete(stream(text, list(range(1, len(text))), **kw))) == want


def _all_splits_fold(text: str, **kw) -> list:
    """The fold of `text`, asserted equal for the whole text, every single cut and one-character deltas."""
    want = simple(fold_complete(parse_complete(text, **kw)))
    for cuts in [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]:
        assert simple(fold_complete(stream(text, cuts, **kw))) == want, cuts
    return want


@pytest.mark.parametrize("text, reasoning, content", [
    ("plan\n</think>\nanswer", "plan", "answer"),  # one newline each side of the end marker is markup
    ("plan\n\n</think>\n\nanswer", "plan\n", "\nanswer"),  # only one
    ("a\nb</think>c\nd", "a\nb", "c\nd"),  # newlines elsewhere are kept
    ("cut off\n", "cut off\n", ""),  # no end marker: the held newline is reasoning after all
])
def test_step3p5_trims_one_newline_around_the_end_marker(text, reasoning, content):
    got = _all_splits_fold(text, reasoning="step3p5")
    assert got == [x for x in [("reasoning", reasoning), ("text", content)] if x[1]]


def test_seed_oss_finds_no_call_inside_its_think_block():
    call = "<seed:tool_call>\n<function=f>\n<parameter=x>1</parameter>\n</function>\n</seed:tool_call>"
    text = f"<seed:think>the format is {call}, so</seed:think>{call}"
    # with its reasoning parser the mention is reasoning; without one, the think block is text; one call either way
    for reasoning in ("seed_oss", None):
        got = _all_splits_fold(text, reasoning=reasoning, tools="seed_oss")
        kinds = [g[0] for g in got]
        assert kinds == ["reasoning" if reasoning else "text", "call"], got
        assert call in got[0][1]


def test_mistral_finds_its_list_after_a_little_noise():
    text = '[TOOL_CALLS] um [{"name": "add", "arguments": {"a": 1}}] after'
    assert _all_splits_fold(text, tools="mistral") == [("call", "add", {"a": 1}), ("text", " after")]
    # no list close by: the marker and what follows are text, nothing dropped
    prose = "[TOOL_CALLS] I cannot call a tool for that. " + "x" * 300 + " [{"
    assert _all_splits_fold(prose, tools="mistral") == [("text", prose)]


def test_harmony_joins_consecutive_messages_of_one_kind_but_not_across_a_call():
    pre = "<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>final<|message|>42.<|end|>"
    assert _all_splits_fold(pre, reasoning="gpt_oss", tools="openai") == [("text", "Let me look.\n42.")]
    two = ("<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>analysis<|message|>B<|end|>"
           "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"
           "<|start|>assistant<|channel|>analysis<|message|>C<|end|>")
    # C is its own message after the call: replayed as one, so no separator is invented for it
    assert _all_splits_fold(two, reasoning="gpt_oss", tools="openai") == [
        ("reasoning", "A\nB"), ("call", "f", {}), ("reasoning", "C")]


def test_every_tool_format_is_in_the_fixture_table():
    """Each tool format ships with a wire writer in parser_cases/wire.py, so the abstract cases cover it."""
    from serve_app.parsers import TOOL_PARSERS
    assert set(TOOL_PARSERS) == {f.tools for f in FORMATS}


@pytest.mark.parametrize("block, want", [
    ('{"path": "a \\"b\\".py", "n": 3}', {"path": 'a "b".py', "n": 3}),  # the object is the arguments
    ("{}", {}),
    ("[1, 2]", None),  # not an object: the call is abandoned and its text kept
    ('{"path": "a.py"', None),  # broken JSON: the same
])
def test_a_kimi_k3_call_written_as_a_json_block_takes_its_object_as_arguments(block, want):
    """Kimi K3's template writes a call whose arguments are a string as one JSON block
    (`<|open|>json type="object"<|sep|>…<|close|>json<|sep|>`) instead of argument elements."""
    first = ('<|open|>call tool="read" index="1"<|sep|><|open|>json type="object"<|sep|>' + block
             + "<|close|>json<|sep|><|close|>call<|sep|>")
    second = ('<|open|>call tool="ls" index="2"<|sep|><|open|>argument key="d" type="string"<|sep|>src'
              "<|close|>argument<|sep|><|close|>call<|sep|>")
    text = "Looking.<|close|>response<|sep|><|open|>tools<|sep|>" + first + second + "<|close|>tools<|sep|>"
    got = _all_splits_fold(text, reasoning="kimi_k3", tools="kimi_k3", starts_in_reasoning=False)
    if want is None:
        assert got == [("text", "Looking.<|open|>tools<|sep|>" + first), ("call", "ls", {"d": "src"})]
    else:
        assert got == [("text", "Looking."), ("call", "read", want), ("call", "ls", {"d": "src"})]


@pytest.mark.parametrize("case", sorted(MINIMAX_M3_CASES))
def test_minimax_m3_argument_elements(case):
    """MiniMax-M3's nested argument elements, typed by the schema; the same fold for every split."""
    text, schemas, want = MINIMAX_M3_CASES[case]
    kw = {"reasoning": "minimax_m3", "tools": "minimax_m3", "tool_schemas": schemas, "starts_in_reasoning": False}
    got = _all_splits_fold(text, **kw)
    assert got == want
    check_events(parse_complete(text, **kw))
