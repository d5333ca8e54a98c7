"""tool_choice grammars (serve_app/parsers/tool_grammar.py), checked with xgrammar's own matcher over SmolLM2's
tokenizer — the grammar engine vLLM runs — and tied to this service's parsers: what a grammar lets the model write
is what the format's parser reads as calls of the allowed tools, with arguments valid against their schemas."""

from __future__ import annotations

import itertools
import json
import random

import jsonschema
import numpy as np
import pytest
import xgrammar as xgr

from serve_app.conversation import ToolCallArgsDelta, ToolCallEnd, ToolCallStart, ToolChoice, ToolSpec
from serve_app.parsers import make_stream_parser
from serve_app.parsers.formats import TOOL_PARSERS
from serve_app.parsers.tool_grammar import SHAPES, check_choice, engine_constraint, structural_tag
from serve_app.prompt import load_tokenizer
from test_prompt_render import smollm2_path

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [ToolSpec("get_weather", parameters=WEATHER),
         ToolSpec("get_time", parameters={"type": "object", "properties": {"zone": {"type": "integer"}}})]
# one call's arguments {"city": "Paris"} in each style xgrammar writes
ARGS = {
    "json": '{"city": "Paris"}',
    "qwen_xml": "<parameter=city>\nParis\n</parameter>\n",
    "minimax_xml": '<parameter name="city">Paris</parameter>\n',
    "deepseek_xml": '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n',
    "deepseek_v4_1_xml": '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n',
    "glm_xml": "<arg_key>city</arg_key><arg_value>Paris</arg_value>",
    "python": 'city="Paris"',
    "gemma": 'city:<|"|>Paris<|"|>',
    "xtml": '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>',
    "elements": "]<]minimax[>[<city>Paris]<]minimax[>[</city>",
}
REASONING = {"openai": "gpt_oss"}  # Harmony parses the whole stream: its tool format goes with its channels


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(smollm2_path())


@pytest.fixture(scope="module")
def info(tok):
    return xgr.TokenizerInfo.from_huggingface(tok)


@pytest.fixture(scope="module")
def compiler(info):
    return xgr.GrammarCompiler(info)


@pytest.fixture(scope="module")
def solid(tok):
    """Token ids whose text is not whitespace only."""
    return {i for i in range(len(tok)) if tok.decode([i]).strip()}


def matcher(compiler, tag):
    return xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))


def allows(compiler, tok, tag, text: str) -> bool:
    """Whether the grammar accepts exactly `text` and then the end of the answer."""
    m = matcher(compiler, tag)
    return m.accept_string(text) and (m.is_terminated() or m.accept_token(tok.eos_token_id))


def one_call(fmt: str, name: str = "get_weather") -> str:
    s = SHAPES[fmt]
    return s.call_begin.format(name=name) + ("0" if s.index_regex else "") + s.args_begin + ARGS[s.args] + s.call_end


def answer(fmt: str, calls: int = 1) -> str:
    s = SHAPES[fmt]
    sep = "" if fmt == "mistral" else s.separator
    return (s.section_begin or "") + sep.join([one_call(fmt)] * calls) + (s.section_end or "")


def lead(fmt: str) -> str:
    """What a forced answer writes before its calls (Kimi K3: the empty response channel its template renders)."""
    got = SHAPES[fmt].forced_lead
    return "".join(got) if got else ""


def calls_of(fmt: str, text: str, tools: list[ToolSpec] = TOOLS) -> list[tuple[str, dict]]:
    """(name, arguments) of every completed call the format's parser reads in `text`."""
    schemas = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters}} for t in tools]
    p = make_stream_parser(reasoning=REASONING.get(fmt), tools=fmt, tool_schemas=schemas)
    names, args, done = {}, {}, []
    for ev in p.push(text) + p.finish():
        if isinstance(ev, ToolCallStart):
            names[ev.index], args[ev.index] = ev.name, ""
        elif isinstance(ev, ToolCallArgsDelta):
            args[ev.index] += ev.arguments
        elif isinstance(ev, ToolCallEnd):
            done.append((names[ev.index], json.loads(args[ev.index] or "{}")))
    return done


def test_every_tool_format_has_a_shape():
    assert set(SHAPES) == set(TOOL_PARSERS)


@pytest.mark.parametrize("fmt", sorted(SHAPES))
def test_each_mode_allows_exactly_what_it_should(fmt, compiler, tok):
    one, two = answer(fmt), answer(fmt, 2)
    if SHAPES[fmt].section_begin is None and fmt != "mistral":
        two = one + SHAPES[fmt].separator + one
    if fmt == "mistral":
        two = one + one
    required = structural_tag(fmt, TOOLS, ToolChoice("required"))
    forced = lead(fmt)
    assert allows(compiler, tok, required, forced + one) and not allows(compiler, tok, required, "Sure, here it is.")
    # Harmony's call ends the turn, so one call is all an answer can hold
    assert allows(compiler, tok, required, forced + two) == (fmt != "openai")
    named = structural_tag(fmt, TOOLS, ToolChoice("tool", name="get_weather"))
    assert allows(compiler, tok, named, forced + one) and not allows(compiler, tok, named, forced + two)
    assert not allows(compiler, tok, named, forced + answer(fmt).replace("get_weather", "get_time"))
    single = structural_tag(fmt, TOOLS, ToolChoice("auto", parallel=False))
    assert allows(compiler, tok, single, "No call needed.") and allows(compiler, tok, single, "Let me check. " + one)
    assert not allows(compiler, tok, single, "Let me check. " + two)
    none = structural_tag(fmt, TOOLS, ToolChoice("none"))
    if fmt in ("pythonic", "llama4_pythonic"):  # calls open with `[`: forbidding that would forbid brackets in prose
        assert none is None
    else:
        assert allows(compiler, tok, none, "Paris is sunny.") and not allows(compiler, tok, none, one)


# two tools with one schema: a call of either is the same text but for the name, so only the allowance decides
TWINS = [ToolSpec("get_weather", parameters=WEATHER), ToolSpec("get_forecast", parameters=WEATHER)]


@pytest.mark.parametrize("fmt", sorted(SHAPES))
def test_allowed_tools_limit_the_calls_to_the_listed_ones(fmt, compiler, tok):
    weather = answer(fmt)
    forecast = weather.replace("get_weather", "get_forecast")
    for mode in ("required", "auto"):
        first = lead(fmt) if mode == "required" else "Let me check. "
        only_weather = structural_tag(fmt, TWINS, ToolChoice(mode, allowed=("get_weather",)))
        only_forecast = structural_tag(fmt, TWINS, ToolChoice(mode, allowed=("get_forecast",)))
        assert allows(compiler, tok, only_weather, first + weather), mode
        assert not allows(compiler, tok, only_weather, first + forecast), mode
        assert allows(compiler, tok, only_forecast, first + forecast), mode
        assert not allows(compiler, tok, only_forecast, first + weather), mode
    # required: calls only; auto: text alone is an answer
    assert not allows(compiler, tok, structural_tag(fmt, TWINS, ToolChoice("required", allowed=("get_weather",))),
                      "Sure, here it is.")
    assert allows(compiler, tok, structural_tag(fmt, TWINS, ToolChoice("auto", allowed=("get_weather",))),
                  "No call needed.")
    # parallel_tool_calls still applies
    single = structural_tag(fmt, TWINS, ToolChoice("required", allowed=("get_weather",), parallel=False))
    two = (one_call(fmt) * 2 if fmt == "mistral" else
           answer(fmt, 2) if SHAPES[fmt].section_begin is not None else
           one_call(fmt) + SHAPES[fmt].separator + one_call(fmt))
    assert allows(compiler, tok, single, lead(fmt) + weather) and not allows(compiler, tok, single, lead(fmt) + two)


@pytest.mark.parametrize("fmt", sorted(SHAPES))
def test_allowing_every_tool_or_none_is_auto_or_none(fmt):
    everything = ToolChoice("auto", allowed=("get_forecast", "get_weather"))
    assert structural_tag(fmt, TWINS, everything) is None  # nothing to enforce: the plain auto
    assert structural_tag(fmt, TWINS, ToolChoice("auto", allowed=())) == structural_tag(fmt, TWINS, ToolChoice("none"))


@pytest.mark.parametrize("fmt, bare", [
    ("qwen3_coder", "<function=get_forecast>\n<parameter=city>\nParis\n</parameter>\n</function>"),
    ("openai", "<|start|>assistant to=functions.get_forecast<|channel|>commentary json<|message|>"
               '{"city": "P"}<|call|>'),
])
def test_auto_text_cannot_hold_a_call_the_triggers_miss(fmt, bare, compiler, tok):
    assert calls_of(fmt, bare, TWINS)  # the parser would read it as a call of a tool that is not allowed
    tag = structural_tag(fmt, TWINS, ToolChoice("auto", allowed=("get_weather",)))
    assert not allows(compiler, tok, tag, "Checking. " + bare)


@pytest.mark.parametrize("fmt", sorted(SHAPES))
def test_the_parser_reads_what_the_grammar_writes(fmt):
    assert calls_of(fmt, answer(fmt)) == [("get_weather", {"city": "Paris"})]


def test_a_kimi_k3_forced_call_follows_the_response_channel_and_its_arguments_are_typed(compiler, tok):
    """Thinking on, the answer opens and closes the (empty) response channel the template writes before calls;
    thinking off the prompt opened it, so the answer only closes it. Non-string arguments are JSON, typed."""
    required = structural_tag("kimi_k3", TOOLS, ToolChoice("tool", name="get_time"))
    call = ('<|open|>tools<|sep|><|open|>call tool="get_time" index="1"<|sep|>'
            '<|open|>argument key="zone" type="number"<|sep|>{}<|close|>argument<|sep|><|close|>call<|sep|>'
            "<|close|>tools<|sep|>")
    for opener in ("<|open|>response<|sep|>", ""):
        assert allows(compiler, tok, required, opener + "<|close|>response<|sep|>" + call.format(3))
    assert not allows(compiler, tok, required, "<|close|>response<|sep|>" + call.format('"three"'))
    assert not allows(compiler, tok, required, call.format(3))  # without the response channel
    empty_call = '<|open|>tools<|sep|><|open|>call tool="get_time" index="1"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
    assert allows(compiler, tok, required, "<|close|>response<|sep|>" + empty_call)  # zone is optional
    assert calls_of("kimi_k3", "<|close|>response<|sep|>" + call.format(3)) == [("get_time", {"zone": 3})]


def test_auto_with_parallel_calls_needs_no_grammar_and_unknown_formats_none():
    assert structural_tag("hermes", TOOLS, ToolChoice("auto")) is None
    assert structural_tag("hermes", [], ToolChoice("none")) is None
    assert structural_tag(None, TOOLS, ToolChoice("required")) is None


def test_a_thinking_model_reasons_before_its_forced_call(compiler, tok):
    call = answer("hermes")
    opened = structural_tag("hermes", TOOLS, ToolChoice("required"), reasoning="qwen3", starts_in_reasoning=True)
    assert allows(compiler, tok, opened, "Weather means a call.</think>\n\n" + call)
    assert not allows(compiler, tok, opened, call)  # the prompt opened the think block: it must close first
    optional = structural_tag("hermes", TOOLS, ToolChoice("required"), reasoning="qwen3")
    assert allows(compiler, tok, optional, "<think>Hmm.</think>\n" + call) and allows(compiler, tok, optional, call)
    # with vLLM's gate the grammar starts after the think block: the tag is the answer alone
    gated = structural_tag("hermes", TOOLS, ToolChoice("required"), reasoning="qwen3", starts_in_reasoning=True,
                           reasoning_gate=True)
    assert gated == structural_tag("hermes", TOOLS, ToolChoice("required"))
    harmony = structural_tag("openai", TOOLS, ToolChoice("required"), reasoning="gpt_oss")
    analysis = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
    assert allows(compiler, tok, harmony, analysis + answer("openai"))


def test_check_choice_names_what_is_wrong():
    assert "'nope'" in check_choice(ToolChoice("tool", name="nope"), TOOLS)
    assert "no tools" in check_choice(ToolChoice("required"), [])
    assert check_choice(ToolChoice("none"), []) is None and check_choice(ToolChoice("tool", name="get_time"), TOOLS) is None
    assert "'nope'" in check_choice(ToolChoice("auto", allowed=("get_time", "nope")), TOOLS)
    assert "allows none" in check_choice(ToolChoice("required", allowed=()), TOOLS)
    assert check_choice(ToolChoice("required", allowed=("get_time",)), TOOLS) is None
    assert check_choice(ToolChoice("auto", allowed=()), TOOLS) is None


def test_the_engine_gets_the_tag_as_json_text():
    tag = structural_tag("hermes", TOOLS, ToolChoice("required"))
    assert json.loads(engine_constraint(tag)["structural_tag"]) == tag


# -- property: anything the grammar lets the model write parses as valid calls --------------------------------------

BOUNDED = [  # finite values, so a random walk through the grammar ends
    ToolSpec("get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", 'Quote"d', "Line\nbreak"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"],
        "additionalProperties": False}),
    ToolSpec("set_flag", parameters={"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
                                     "additionalProperties": False}),
]


def _walk(compiler, info, tok, solid, tag, rng: random.Random, limit: int = 400) -> str | None:
    """A random path through the grammar, one allowed token at a time (whitespace-only tokens made rare)."""
    m = matcher(compiler, tag)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    ids: list[int] = []
    for _ in range(limit):
        if m.is_terminated():
            return tok.decode(ids)
        m.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[: len(tok)]
        allowed = np.flatnonzero(bits).tolist()
        if tok.eos_token_id in allowed and rng.random() < 0.5:
            return tok.decode(ids)
        firm = [i for i in allowed if i != tok.eos_token_id and i in solid]
        pick = rng.choice(firm if firm and rng.random() < 0.95 else allowed)
        if pick == tok.eos_token_id:
            return tok.decode(ids)
        assert m.accept_token(pick)
        ids.append(pick)
    return None


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "kimi_k2", "minimax_m2", "deepseek_v32", "glm47", "pythonic",
                                 "gemma4", "minimax_m3"])
def test_random_paths_through_a_forced_grammar_parse_as_schema_valid_calls(fmt, compiler, info, tok, solid):
    rng = random.Random(fmt)
    schemas = {t.name: t.parameters for t in BOUNDED}
    done = 0
    for choice in (ToolChoice("required"), ToolChoice("tool", name="get_weather"),
                   ToolChoice("required", allowed=("set_flag",))):
        tag = structural_tag(fmt, BOUNDED, choice)
        for _ in range(3):
            text = _walk(compiler, info, tok, solid, tag, rng)
            if text is None:  # the walk ran long (whitespace); nothing to judge
                continue
            calls = calls_of(fmt, text, BOUNDED)
            assert calls, text
            if choice.mode == "tool":
                assert [n for n, _ in calls] == ["get_weather"], text
            if choice.allowed is not None:
                assert {n for n, _ in calls} <= set(choice.allowed), text
            for name, arguments in calls:
                if SHAPES[fmt].args != "json":
                    # xgrammar's XML styles let whitespace pad a value ("<parameter=city> Paris\n</parameter>" is
                    # "Paris" to it); the parser keeps what was written, minus the template's own newlines
                    arguments = {k: v.strip() if isinstance(v, str) else v for k, v in arguments.items()}
                jsonschema.validate(arguments, schemas[name])
            done += 1
    assert done >= 3


# -- pythonic: keyword arguments, Python literals, checked against the schema --------------------------------------

RICH = ToolSpec("plan", parameters={"type": "object", "properties": {
    "title": {"type": "string", "minLength": 2},
    "steps": {"type": "array", "items": {"type": "object", "properties": {
        "done": {"type": "boolean"}, "note": {"type": ["string", "null"]}}, "required": ["done"]}, "maxItems": 2},
    "mode": {"enum": ["fast", None, True]},
    "extra": {},
    "ratio": {"type": "number", "minimum": 0},
}, "required": ["title", "steps"]})
NOARGS = ToolSpec("ping", parameters={"type": "object", "properties": {}})


@pytest.mark.parametrize("args, ok", [
    ('title="Go", steps=[]', True),
    ('title="Go", steps=[{"done": True, "note": None}, {"done": False}], mode=None, extra={"k": [1, False]}, '
     'ratio=0.5', True),
    ('title="Go", steps=[], mode="fast"', True),
    ('title="Go", steps=[], mode=True', True),
    ('title="Go", steps=[], ratio=2', True),
    ('steps=[]', False),  # a required name missing
    ('title="Go"', False),
    ('title="G", steps=[]', False),  # minLength, xgrammar's own check
    ('title="Go", steps=[{"done": true}]', False),  # JSON's true is not Python's
    ('title="Go", steps=[{"note": "x"}]', False),  # a required key of a nested dict missing
    ('title="Go", steps=[{"done": True}, {"done": True}, {"done": True}]', False),  # maxItems
    ('title="Go", steps=[], mode="slow"', False),  # not in the enum
    ('title="Go", steps=[], ratio=-1', False),  # minimum
    ('title=3, steps=[]', False),  # wrong type
    ('title="Go", steps=[], colour="red"', False),  # an undeclared name
    ('steps=[], title="Go"', False),  # the schema's order, as xgrammar's JSON styles keep it
])
def test_pythonic_arguments_follow_the_schema(args, ok, compiler, tok):
    check_plan_call("pythonic", f"[plan({args})]", ok, compiler, tok)


def check_plan_call(fmt: str, text: str, ok: bool, compiler, tok) -> None:
    """`required` over RICH and NOARGS allows `text` exactly when `ok`, and the parser reads an allowed one as a
    schema-valid call of `plan`."""
    tag = structural_tag(fmt, [RICH, NOARGS], ToolChoice("required"))
    assert allows(compiler, tok, tag, text) is ok
    if ok:
        [(name, parsed)] = calls_of(fmt, text, [RICH, NOARGS])
        assert name == "plan"
        jsonschema.validate(parsed, RICH.parameters)


def test_pythonic_calls_without_arguments_and_with_a_free_schema(compiler, tok):
    tag = structural_tag("pythonic", [RICH, NOARGS], ToolChoice("tool", name="ping"))
    assert allows(compiler, tok, tag, "[ping()]") and not allows(compiler, tok, tag, "[ping(x=1)]")
    free = [ToolSpec("anything", parameters={"type": "object", "additionalProperties": True,
                                             "$defs": {}, "$ref": "#/$defs/x"})]
    tag = structural_tag("pythonic", free, ToolChoice("required"))
    # a schema the composition does not follow: any keyword arguments, each a Python literal
    assert allows(compiler, tok, tag, '[anything(a=1, b=[True, None])]') and allows(compiler, tok, tag, "[anything()]")
    assert not allows(compiler, tok, tag, "[anything(a=true)]") and not allows(compiler, tok, tag, "[anything(1)]")


def test_pythonic_optional_arguments_may_all_be_left_out_and_the_grammar_grows_linearly(compiler, tok):
    def tool(n):
        return ToolSpec("opts", parameters={"type": "object", "properties": {
            f"p{i}": {"type": "boolean"} if i % 2 else {"type": "integer"} for i in range(n)}})

    tag = structural_tag("pythonic", [tool(3)], ToolChoice("required"))
    assert allows(compiler, tok, tag, "[opts()]") and allows(compiler, tok, tag, "[opts(p1=False)]")
    assert allows(compiler, tok, tag, "[opts(p0=4, p2=5)]") and not allows(compiler, tok, tag, "[opts(, p1=False)]")
    assert not allows(compiler, tok, tag, "[opts(p0=4 p2=5)]") and not allows(compiler, tok, tag, "[opts(p1=1)]")
    # rules share each argument list's tail: twice the properties, about twice the grammar (a tree would be 4x)
    sizes = [len(json.dumps(structural_tag("pythonic", [tool(n)], ToolChoice("required")))) for n in (20, 40)]
    assert sizes[1] < 2.5 * sizes[0]


# -- gemma4: Gemma 4's notation, checked against the schema --------------------------------------------------------

G = '<|"|>'  # Gemma 4's string delimiter


def _g(text: str) -> str:
    return text.replace("'", G)  # tests write a string 'x' for <|"|>x<|"|>


@pytest.mark.parametrize("args, ok", [
    ("title:'Go',steps:[]", True),
    ("title:'Go',steps:[{done:true,note:null},{done:false}],mode:null,extra:{k:[1,false]},ratio:0.5", True),
    ("title:'Go',steps:[],mode:'fast'", True),
    ("title:'Go',steps:[],mode:true", True),
    ("title:'Go',steps:[],ratio:2", True),
    ("title:'Go',steps:[{done:true,note:'a \"b\", {c}: [d] <|x\n'}]", True),  # a string holds the notation's marks
    ("title:'Go',steps:[{done:true,note:'\\ <|\"|'}]", True),  # and a bare start of the delimiter
    ("steps:[]", False),  # a required key missing
    ("title:'Go'", False),
    ("title:'G',steps:[]", False),  # minLength
    ('title:"Go",steps:[]', False),  # JSON's quotes are not Gemma's
    ("title:'Go',steps:[{done:True}]", False),  # Python's True is not Gemma's
    ("title:'Go',steps:[{note:'x'}]", False),  # a required key of a nested object missing
    ("title:'Go',steps:[{done:true},{done:true},{done:true}]", False),  # maxItems
    ("title:'Go',steps:[],mode:'slow'", False),  # not in the enum
    ("title:'Go',steps:[],ratio:-1", False),  # minimum
    ("title:3,steps:[]", False),  # wrong type
    ("title:'Go',steps:[],colour:'red'", False),  # an undeclared key
    ("steps:[],title:'Go'", False),  # the schema's order
    ("title:'Go', steps:[]", False),  # the template's spacing: none
    ("title:'Go',steps:[{done:true,note:'a'b'}]", False),  # a string cannot hold the delimiter
])
def test_gemma4_arguments_follow_the_schema(args, ok, compiler, tok):
    check_plan_call("gemma4", "<|tool_call>call:plan{" + _g(args) + "}<tool_call|>", ok, compiler, tok)


def test_gemma4_strings_are_any_text_without_the_delimiter(compiler, tok):
    """Every text over the delimiter's characters up to 5 long: written iff it holds no delimiter, read back as is."""
    tool = ToolSpec("say", parameters={"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]})
    grammar = compiler.compile_structural_tag(json.dumps(structural_tag("gemma4", [tool], ToolChoice("required"))))
    seen = 0
    for n in range(6):
        for chars in itertools.product('<|">a', repeat=n):
            s = "".join(chars)
            text = f"<|tool_call>call:say{{s:{G}{s}{G}}}<tool_call|>"
            m = xgr.GrammarMatcher(grammar)
            ok = m.accept_string(text) and (m.is_terminated() or m.accept_token(tok.eos_token_id))
            assert ok is (G not in s), s
            if ok:
                assert calls_of("gemma4", text, [tool]) == [("say", {"s": s})], s
                seen += 1
    assert seen > 3000


def test_gemma4_checked_strings_and_numbers(compiler, tok):
    tool = ToolSpec("book", parameters={"type": "object", "properties": {
        "day": {"type": "string", "format": "date"}, "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "note": {"type": "string", "maxLength": 3}, "seats": {"type": "integer", "minimum": 1, "maximum": 4}}})
    tag = structural_tag("gemma4", [tool], ToolChoice("required"))

    def ok(args: str) -> bool:
        return allows(compiler, tok, tag, "<|tool_call>call:book{" + _g(args) + "}<tool_call|>")

    assert ok("day:'2025-01-31',code:'CDG',note:'a\nb',seats:4") and ok("") and ok("note:''")
    assert not ok("day:'31/01/2025'") and not ok("code:'cdg'") and not ok("code:'CDGX'")
    assert not ok("note:'abcd'") and not ok("note:'a\"b'")  # a length-checked string is written without `"`
    assert not ok("seats:5") and not ok("seats:'2'")


def test_gemma4_what_the_notation_cannot_write_is_not_written(compiler, tok):
    odd = {"type": "object", "properties": {"a:b": {"type": "integer"}, " pad": {"type": "integer"},
                                            "ok": {"enum": ["x", f"y{G}z"]}}}
    tag = structural_tag("gemma4", [ToolSpec("odd", parameters=odd)], ToolChoice("required"))
    call = "<|tool_call>call:odd{{{}}}<tool_call|>".format
    assert allows(compiler, tok, tag, call("")) and allows(compiler, tok, tag, call(_g("ok:'x'")))
    assert not allows(compiler, tok, tag, call("a:b:1")) and not allows(compiler, tok, tag, call(" pad:1"))
    assert not allows(compiler, tok, tag, call(_g(f"ok:'y{G}z'")))
    # a required key it cannot write: the call cannot be written at all
    stuck = dict(odd, required=["a:b"])
    tag = structural_tag("gemma4", [ToolSpec("odd", parameters=stuck)], ToolChoice("required"))
    assert not allows(compiler, tok, tag, call("")) and not allows(compiler, tok, tag, call("a:b:1"))


def test_gemma4_calls_without_arguments_and_with_a_free_schema(compiler, tok):
    tag = structural_tag("gemma4", [RICH, NOARGS], ToolChoice("tool", name="ping"))
    ping = "<|tool_call>call:ping{}<tool_call|>"
    assert allows(compiler, tok, tag, ping) and not allows(compiler, tok, tag, ping.replace("{}", "{x:1}"))
    assert calls_of("gemma4", ping, [NOARGS]) == [("ping", {})]
    free = [ToolSpec("anything", parameters={"type": "object", "additionalProperties": True,
                                             "$defs": {}, "$ref": "#/$defs/x"})]
    tag = structural_tag("gemma4", free, ToolChoice("required"))
    text = "<|tool_call>call:anything{" + _g("a:1,b:[true,null,'s'],c:{d:-2.5e3}") + "}<tool_call|>"
    assert allows(compiler, tok, tag, text) and allows(compiler, tok, tag, "<|tool_call>call:anything{}<tool_call|>")
    assert calls_of("gemma4", text, free) == [("anything", {"a": 1, "b": [True, None, "s"], "c": {"d": -2500.0}})]
    assert not allows(compiler, tok, tag, "<|tool_call>call:anything{a:True}<tool_call|>")
    assert not allows(compiler, tok, tag, "<|tool_call>call:anything{a}<tool_call|>")


NESTED = [ToolSpec("note", parameters={"type": "object", "properties": {
    "text": {"type": "string", "maxLength": 6},
    "tags": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
        "k": {"type": "boolean"}, "v": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["v"]}},
    "mode": {"enum": ["a", None, 1.5, [1, "b"], {"c": True}]}}, "required": ["text"]})]


@pytest.mark.parametrize("fmt", ["pythonic", "gemma4"])
def test_random_paths_through_nested_arguments_parse_as_schema_valid_calls(fmt, compiler, info, tok, solid):
    """Free text in bounded strings, nested arrays and objects, structured enum values, ranged numbers."""
    rng = random.Random(fmt)
    tag = structural_tag(fmt, NESTED, ToolChoice("required", parallel=False))
    done = 0
    for _ in range(12):
        text = _walk(compiler, info, tok, solid, tag, rng)
        if text is None:
            continue
        [(name, arguments)] = calls_of(fmt, text, NESTED)
        jsonschema.validate(arguments, NESTED[0].parameters)
        done += 1
    assert done >= 6
