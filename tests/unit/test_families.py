"""The model-family catalog against the families' real templates (serve_app/families/templates/).

Per family: the vendored file is the one the catalog names (blob id), its parsers exist, the kwargs it lists are
read by the template, `thinking_in_prompt` and `thinking_replay` are what the template does when the service
renders it, and an assistant turn — reasoning, text and several tool calls with hard arguments — rendered through
the template into what the model would emit, then parsed (whole, in random splits, one character at a time),
gives back the same turn; re-rendering the parsed turn gives back the same text byte for byte (what the KV cache
needs). What a template cannot express is a catalog flag, asserted here.

All on SmolLM2's tokenizer (the text path is the same; only token ids differ).
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from serve_app.conversation import (
    Conversation,
    GenerationOptions,
    Message,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    ToolSpec,
)
from serve_app.errors import InvalidRequest
from serve_app.families import Family, apply_family, get_family, load_catalog
from serve_app.parsers import REASONING_PARSERS, TOOL_PARSERS, fold_complete, make_stream_parser, parse_complete
from serve_app.parsers.formats import tool_start_markers
from serve_app.prompt import PromptRenderer, load_tokenizer
from serve_app.prompt.policy import decide_policy
from serve_app.protocols.responses import ReasoningParam
from serve_app.settings import ModelConfig
from tests.support.stability import unreplayed_empty_block

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = sorted(load_catalog())
REQUIRED = {"nemotron-3", "qwen3-coder", "qwen3", "glm-4.6", "kimi-k2", "deepseek-v3.1", "gpt-oss", "minimax-m2"}

# -- the assistant turn ------------------------------------------------------------------------------------------

SCHEMAS = [
    ToolSpec("write_file", "Write a file.", {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
        "ratio": {"type": "number"}, "overwrite": {"type": "boolean"}, "tags": {"type": "array"},
        "meta": {"type": "object"}}, "required": ["path", "content"]}),
    ToolSpec("refresh", "Refresh the index.", {"type": "object", "properties": {}}),
    ToolSpec("put_blob", "Store a blob.", {"type": "object", "properties": {"data": {"type": "string"}},
                                             "required": ["data"]}),
]
BIG = ("Zeile ünïcödé 文件 \"quoted\" back\\slash\ttab\n" * 600)[:20_000].strip()
CALLS = [
    ("write_file", {"path": "src/ünïcode/文件 名.py",
                    "content": 'def f():\n    return "say \\"hi\\"" + \'single\'  # back\\slash \\n 😀',
                    "mode": 420, "ratio": 0.5, "overwrite": True, "tags": ["a", "b c"],
                    "meta": {"nested": {"k": [1, {"z": None}], "s": "x\"y"}, "ok": False}}),
    ("refresh", {}),
    ("put_blob", {"data": BIG}),
]
REASONING = "The user wants a file. I will write it, refresh, then store the blob — \"carefully\"."
TEXT = "Writing the file now."


def call_id(fam: Family, name: str, i: int) -> str:
    # Kimi's template renders each call's own id: the model's form is functions.NAME:IDX.
    return f"functions.{name}:{i}" if fam.tool_parser == "kimi_k2" else f"call_{i}"


def turn(fam: Family, calls=CALLS, text: str | None = TEXT, reasoning: str | None = REASONING) -> list:
    parts: list = []
    if reasoning is not None and fam.reasoning_parser:
        parts.append(ReasoningPart(reasoning))
    if text:
        parts.append(TextPart(text))
    parts += [ToolCallPart(call_id(fam, n, i), n, json.dumps(a, ensure_ascii=False)) for i, (n, a) in enumerate(calls)]
    return parts


def full_turn(fam: Family) -> list:
    """The richest turn the template can express."""
    calls = CALLS if fam.parallel_calls else CALLS[:1]
    text = TEXT if (fam.text_reasoning_and_calls or not fam.reasoning_parser) and fam.text_before_calls else None
    return turn(fam, calls, text, REASONING if fam.reasoning_with_calls else None)


# -- helpers -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer_path():
    from serve_app.engine.provision import default_tokenizer_source

    return default_tokenizer_source()


_RENDERERS: dict[str, PromptRenderer] = {}


def renderer(path: str, name: str) -> PromptRenderer:
    if name not in _RENDERERS:
        model = ModelConfig(id="m", family=name, family_template=True)
        _RENDERERS[name] = PromptRenderer(load_tokenizer(path, model.chat_template), model)
    return _RENDERERS[name]


def base_conv() -> Conversation:
    return Conversation(messages=[Message("system", [TextPart("You are a coding agent.")]),
                                  Message("user", [TextPart("Write the file, refresh, store the blob.")])],
                        tools=SCHEMAS)


def emitted(r: PromptRenderer, fam: Family, parts: list, opts: GenerationOptions) -> tuple[str, bool]:
    """What the model generated for `parts`: the conversation rendered with the turn as its last message, minus
    the prompt rendered with the generation prompt, minus the end-of-turn token (and what the template writes
    after it). Also whether the prompt leaves the model inside reasoning."""
    conv = base_conv()
    prompt = r.render_sync(conv, opts)
    with_turn = Conversation(messages=[*conv.messages, Message("assistant", parts)], tools=conv.tools)
    text = r.render_text(with_turn, opts, add_generation_prompt=False)
    # Thinking off, a template may drop the empty think block its generation prompt closed (catalog flag)
    block = "" if fam.empty_thought_replayed else unreplayed_empty_block(prompt.text, text, r.policy.markers)
    head = prompt.text[: len(prompt.text) - len(block)]
    assert text.startswith(head), f"{fam.name}: the rendered turn does not extend the generation prompt"
    out = text[len(head):]
    stops = fam.turn_ends(r.tokenizer.eos_token)
    ends = [out.rfind(t) for t in stops if t in out]
    if ends:
        cut = max(ends)
        assert not out[cut:].strip() or out[cut:].strip() in stops, out[cut:]
        out = out[:cut]
    return out, prompt.starts_in_reasoning


def schemas() -> list[dict]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in SCHEMAS]


def parse(fam: Family, text: str, starts_in_reasoning: bool) -> list:
    return parse_complete(text, reasoning=fam.reasoning_parser, tools=fam.tool_parser, tool_schemas=schemas(),
                          starts_in_reasoning=starts_in_reasoning)


def stream(fam: Family, text: str, cuts: list[int], starts_in_reasoning: bool) -> list:
    p = make_stream_parser(fam.reasoning_parser, fam.tool_parser, schemas(), starts_in_reasoning)
    out: list = []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        out += p.push(text[a:b])
    return out + p.finish()


def folded(events: list, keep_ids: bool) -> list:
    """Parts without the random call ids (Kimi's own ids are the model's and are compared)."""
    out = []
    for p in fold_complete(events):
        if isinstance(p, ToolCallPart):
            out.append(("call", p.id if keep_ids else None, p.name, p.arguments))
        else:
            out.append((type(p).__name__, p.text))
    return out


def as_parts(fam: Family, events: list) -> list:
    return fold_complete(events)


def _untyped(v, schema=None):
    """A value as a template that writes values untyped gives it back (MiniMax-M3: `Family.typed_values` false):
    what the schema describes keeps its type, anything else is text (a None member left out, a None item empty)."""
    if isinstance(schema, dict) and schema.get("type") in ("object", "array"):
        if isinstance(v, dict):
            props = schema.get("properties") or {}
            return {k: _untyped(x, props.get(k)) for k, x in v.items() if x is not None}
        if isinstance(v, list):
            return [_untyped(x, schema.get("items")) for x in v]
    if isinstance(schema, dict) and schema.get("type"):
        return v
    if isinstance(v, dict):
        return {k: _untyped(x) for k, x in v.items() if x is not None} or ""
    if isinstance(v, list):
        return [_untyped(x) for x in v] or ""
    return "" if v is None else json.dumps(v) if isinstance(v, bool) else str(v)


def semantic(parts: list, fam: Family | None = None) -> list:
    """What a turn means: reasoning and text without surrounding whitespace (templates frame them with newlines),
    calls with their parsed arguments in order (as the template can write them: `Family.typed_values`)."""
    out = []
    tools = {t.name: t.parameters for t in SCHEMAS}
    for p in parts:
        if isinstance(p, ToolCallPart):
            args = json.loads(p.arguments or "{}")
            if fam is not None and not fam.typed_values:
                args = _untyped(args, tools.get(p.name))
            out.append(("call", p.name, args))
        elif p.text.strip():
            out.append((type(p).__name__, p.text.strip()))
    return out


def kimi(fam: Family) -> bool:
    return fam.tool_parser == "kimi_k2"


# -- the catalog -------------------------------------------------------------------------------------------------

def test_catalog_covers_the_families_agents_run():
    assert REQUIRED <= set(FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_entry_names_real_parsers_and_its_vendored_file(name):
    fam = get_family(name)
    assert fam.reasoning_parser is None or fam.reasoning_parser in REASONING_PARSERS
    assert fam.tool_parser is None or fam.tool_parser in TOOL_PARSERS
    data = fam.template_path.read_bytes()
    assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == fam.source.blob  # git hash-object
    # a template written here reproduces an encoder at a release tag (checked against it: test_deepseek_v4_template)
    assert (len(fam.source.commit) == 40 or fam.source.written_here) and fam.source.license
    text = fam.template_text()
    for kwarg in fam.chat_template_kwargs:
        assert kwarg in text, f"{name}: the template never reads {kwarg}"
    for kwarg in fam.default_chat_template_kwargs:
        assert kwarg in fam.chat_template_kwargs
    assert any(t in text for t in fam.stop_tokens) or "eos_token" in text, \
        f"{name}: no stop token appears in the template"


def test_config_names_a_family_instead_of_repeating_its_fields():
    m = ModelConfig(id="m", family="glm-4.7")
    fam = get_family("glm-4.7")
    assert (m.reasoning_parser, m.tool_parser) == (fam.reasoning_parser, fam.tool_parser)
    assert m.default_chat_template_kwargs == {"clear_thinking": False}
    assert m.chat_template is None  # the tokenizer's own template unless family_template is set
    explicit = ModelConfig(id="m", family="glm-4.7", tool_parser="hermes",
                           default_chat_template_kwargs={"clear_thinking": True, "x": 1})
    assert explicit.tool_parser == "hermes" and explicit.reasoning_parser == "glm47"
    assert explicit.default_chat_template_kwargs == {"clear_thinking": True, "x": 1}
    assert ModelConfig(id="m", family="qwen3", family_template=True).chat_template == str(
        get_family("qwen3").template_path)
    assert apply_family({"id": "m"}) == {"id": "m"}
    with pytest.raises(ValueError, match="unknown model family 'nope'"):
        ModelConfig(id="m", family="nope")
    with pytest.raises(ValueError, match="family_template needs a family"):
        ModelConfig(id="m", family_template=True)


def test_cli_prints_the_catalog_as_json():
    out = subprocess.run([sys.executable, "-m", "serve_app", "families", "--json"], cwd=ROOT, check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout
    data = json.loads(out)
    assert set(data) == set(FAMILIES)
    nem = data["nemotron-3"]
    assert nem["source"]["commit"] and nem["source"]["path"].endswith(".jinja") and nem["source"]["license"]
    assert (nem["reasoning_parser"], nem["tool_parser"], nem["thinking_replay"]) == (
        "nemotron_v3", "qwen3_coder", "keeps_all")
    assert "truncate_history_thinking" in nem["chat_template_kwargs"]
    assert "thinking off" in nem["parser_kwargs"]["force_nonempty_content"]
    assert data["qwen3-coder"]["parser_kwargs"] == {}  # no reasoning, nothing to give


# -- what the template does, against what the catalog says -------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_thinking_in_prompt_is_what_the_template_renders(tokenizer_path, name):
    fam = get_family(name)
    r = renderer(tokenizer_path, name)
    rendered = r.render_sync(base_conv(), GenerationOptions(thinking=True))
    assert rendered.starts_in_reasoning is fam.thinking_in_prompt
    off = r.render_sync(base_conv(), GenerationOptions(thinking=False))
    if fam.thinking_can_be_disabled:  # thinking off never leaves the model inside reasoning
        assert off.starts_in_reasoning is False and off.text != rendered.text
    else:  # the template ignores the request: it thinks (or not) all the same
        assert off.starts_in_reasoning is fam.thinking_in_prompt


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_served_with_another_template_is_reported_and_its_own_is_not(tokenizer_path, name, caplog):
    """A `family` entry whose checkpoint's own template is another family's (here SmolLM2's, which writes no think
    or call markup) gets a warning naming the markers; with the family's template, none."""
    fam = get_family(name)
    with caplog.at_level("WARNING", logger="serve_app.prompt.render"):
        PromptRenderer(load_tokenizer(tokenizer_path), ModelConfig(id="other", family=name))
        renderer(tokenizer_path, name)
    warned = [rec.getMessage() for rec in caplog.records if "never writes" in rec.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("model other:"), warned
    if fam.reasoning_parser:
        assert fam.reasoning_parser in warned[0]
    assert f"{fam.tool_parser} tool calls" in warned[0] or not tool_start_markers(TOOL_PARSERS[fam.tool_parser])


def _replay_probe(r: PromptRenderer, fam: Family) -> str:
    """Render a two-query history whose assistant turns each carry a distinct thought, as the service does."""
    def a(i: int, call: bool) -> Message:
        parts = [ReasoningPart(f"thought number {i} here")]
        if not call or fam.text_reasoning_and_calls:
            parts.append(TextPart(f"answer {i}"))
        if call:
            parts.append(ToolCallPart(f"functions.refresh:{i}", "refresh", "{}"))
        return Message("assistant", parts)

    msgs = [Message("user", [TextPart("first query")]), a(0, True),
            Message("user", [ToolResultPart("functions.refresh:0", "ok")]), a(1, False),
            Message("user", [TextPart("second query")]), a(2, True),
            Message("user", [ToolResultPart("functions.refresh:2", "ok")])]
    text = r.render_text(Conversation(messages=msgs, tools=SCHEMAS), GenerationOptions(thinking=True))
    kept = [i for i in range(3) if f"thought number {i} here" in text]
    return {(0, 1, 2): "keeps_all", (2,): "last_turn", (): "drops"}.get(tuple(kept), f"kept {kept}")


@pytest.mark.parametrize("name", FAMILIES)
def test_thinking_replay_is_what_the_template_renders(tokenizer_path, name):
    fam = get_family(name)
    if not fam.reasoning_parser:
        assert fam.thinking_replay == "drops"  # nothing to replay
        return
    assert _replay_probe(renderer(tokenizer_path, name), fam) == fam.thinking_replay


# -- render → parse round trip -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_turn_renders_then_parses_back_to_itself(tokenizer_path, name):
    fam = get_family(name)
    r = renderer(tokenizer_path, name)
    opts = GenerationOptions(thinking=True)
    original = full_turn(fam)
    text, in_reasoning = emitted(r, fam, original, opts)
    events = parse(fam, text, in_reasoning)
    parts = fold_complete(events)
    assert semantic(parts, fam) == semantic(original, fam), f"{name}: emitted {text[:600]!r}"
    if kimi(fam):
        assert [p.id for p in parts if isinstance(p, ToolCallPart)] == [
            p.id for p in original if isinstance(p, ToolCallPart)]
    # Fixed point: what the parser gave back renders to the same text, byte for byte.
    again, _ = emitted(r, fam, parts, opts)
    assert again == text
    assert folded(parse(fam, again, in_reasoning), kimi(fam)) == folded(events, kimi(fam))


@pytest.mark.parametrize("name", FAMILIES)
def test_turn_streams_the_same_in_any_split(tokenizer_path, name):
    fam = get_family(name)
    r = renderer(tokenizer_path, name)
    text, in_reasoning = emitted(r, fam, full_turn(fam), GenerationOptions(thinking=True))
    whole = folded(parse(fam, text, in_reasoning), kimi(fam))
    rng = random.Random(name)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 60)))
        assert folded(stream(fam, text, cuts, in_reasoning), kimi(fam)) == whole, f"{name}: cuts {cuts}"
    assert folded(stream(fam, text, list(range(1, len(text))), in_reasoning), kimi(fam)) == whole


# A template that opens the think block whatever the request says (MiniMax-M2) never sees a turn without reasoning.
@pytest.mark.parametrize("name", [n for n in FAMILIES
                                  if get_family(n).thinking_can_be_disabled or not get_family(n).thinking_in_prompt])
def test_turn_without_thinking_round_trips(tokenizer_path, name):
    fam = get_family(name)
    r = renderer(tokenizer_path, name)
    opts = GenerationOptions(thinking=False)
    original = turn(fam, CALLS if fam.parallel_calls else CALLS[:1], TEXT if fam.text_before_calls else None,
                    reasoning=None)
    text, in_reasoning = emitted(r, fam, original, opts)
    assert in_reasoning is False
    parts = fold_complete(parse(fam, text, in_reasoning))
    expected = semantic(original, fam)
    if not fam.text_with_calls:  # the template writes a call turn's text as reasoning (catalog `limits`)
        expected = [("ReasoningPart", e[1]) if e[0] == "TextPart" else e for e in expected]
    assert semantic(parts, fam) == expected, f"{name}: emitted {text[:600]!r}"


# -- what a template cannot express --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [n for n in FAMILIES if not get_family(n).parallel_calls])
def test_template_without_parallel_calls_renders_only_the_first(tokenizer_path, name):
    fam = get_family(name)
    r = renderer(tokenizer_path, name)
    text, in_reasoning = emitted(r, fam, turn(fam, CALLS, None), GenerationOptions(thinking=True))
    calls = [p.name for p in fold_complete(parse(fam, text, in_reasoning)) if isinstance(p, ToolCallPart)]
    assert calls == [CALLS[0][0]]


@pytest.mark.parametrize("name", [n for n in FAMILIES if not get_family(n).text_reasoning_and_calls])
def test_template_refuses_text_with_reasoning_and_calls(tokenizer_path, name):
    fam = get_family(name)
    r = renderer(tokenizer_path, name)
    conv = Conversation(messages=[*base_conv().messages, Message("assistant", turn(fam, CALLS[:1], TEXT)),
                                  Message("user", [TextPart("next")])], tools=SCHEMAS)
    with pytest.raises(InvalidRequest, match="the chat template rejected the request"):
        r.render_sync(conv, GenerationOptions(thinking=True))


@pytest.mark.parametrize("name", FAMILIES)
def test_tools_reach_the_prompt_as_the_catalog_says(tokenizer_path, name):
    fam = get_family(name)
    prompt = renderer(tokenizer_path, name).render_sync(base_conv(), GenerationOptions(thinking=True)).text
    assert all(t.name in prompt for t in SCHEMAS) is fam.declares_tools


@pytest.mark.parametrize("name", [n for n in FAMILIES if not get_family(n).reasoning_with_calls])
def test_template_drops_the_reasoning_of_a_tool_call_turn(tokenizer_path, name):
    fam = get_family(name)
    r = renderer(tokenizer_path, name)
    text, in_reasoning = emitted(r, fam, turn(fam, CALLS[:1], TEXT), GenerationOptions(thinking=True))
    assert REASONING not in text
    assert semantic(fold_complete(parse(fam, text, in_reasoning))) == semantic(turn(fam, CALLS[:1], TEXT, None))


@pytest.mark.parametrize("name", [n for n in FAMILIES if not get_family(n).text_before_calls])
def test_template_writes_a_call_turns_text_after_its_calls_and_results(tokenizer_path, name):
    fam = get_family(name)
    r = renderer(tokenizer_path, name)
    text, in_reasoning = emitted(r, fam, turn(fam, CALLS[:1], TEXT, None), GenerationOptions(thinking=True))
    assert semantic(fold_complete(parse(fam, text, in_reasoning))) == semantic(turn(fam, CALLS[:1], None, None)) + [
        ("TextPart", TEXT)]
    conv = Conversation(messages=[*base_conv().messages, Message("assistant", turn(fam, CALLS[:1], TEXT, None)),
                                  Message("user", [ToolResultPart(call_id(fam, CALLS[0][0], 0), "written")])],
                        tools=SCHEMAS)
    prompt = r.render_sync(conv, GenerationOptions(thinking=True)).text
    assert prompt.index("written") < prompt.index(TEXT)


@pytest.mark.parametrize("name", [n for n in FAMILIES if not get_family(n).reasoning_with_answers])
def test_template_drops_the_reasoning_of_an_answer(tokenizer_path, name):
    fam = get_family(name)
    r = renderer(tokenizer_path, name)
    text, _ = emitted(r, fam, [ReasoningPart(REASONING), TextPart(TEXT)], GenerationOptions(thinking=True))
    assert REASONING not in text and TEXT in text


@pytest.mark.parametrize("name", [n for n in FAMILIES if not get_family(n).empty_thought_replayed])
def test_template_drops_the_empty_think_block_of_a_thinking_off_prompt(tokenizer_path, name):
    r = renderer(tokenizer_path, name)
    opts = GenerationOptions(thinking=False)
    prompt = r.render_sync(base_conv(), opts).text
    conv = Conversation(messages=[*base_conv().messages, Message("assistant", [TextPart(TEXT)])], tools=SCHEMAS)
    history = r.render_text(conv, opts, add_generation_prompt=False)
    block = unreplayed_empty_block(prompt, history, r.policy.markers)
    assert block and prompt.endswith(block) and history.startswith(prompt[: -len(block)] + TEXT)


@pytest.mark.parametrize("name", FAMILIES)
def test_no_argument_call_is_expressed_as_the_catalog_says(tokenizer_path, name):
    fam = get_family(name)
    r = renderer(tokenizer_path, name)
    always_thinks = fam.thinking_in_prompt and not fam.thinking_can_be_disabled
    original = turn(fam, [("refresh", {})], None, REASONING if always_thinks else None)
    text, in_reasoning = emitted(r, fam, original, GenerationOptions(thinking=False))
    parts = fold_complete(parse(fam, text, in_reasoning))
    assert (semantic(parts) == semantic(original)) is fam.no_argument_calls, text


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("thinking", [True, False])
def test_a_prefill_ends_the_prompt_with_the_assistant_text(tokenizer_path, name, thinking):
    """Anthropic's prefill on each real template: the prompt is the history, then the final assistant message's
    text with no end of turn; the model continues it as answer text. DeepSeek-V3.2's encoder refuses an answer
    without reasoning after the last user message in thinking mode, so a prefill there gets the template's own
    reason, in the request's error (Anthropic's API refuses a prefill with thinking on as well)."""
    r = renderer(tokenizer_path, name)
    conv = base_conv()
    conv.messages.append(Message("assistant", [TextPart("The file is")]))
    if name == "deepseek-v3.2" and thinking:
        with pytest.raises(InvalidRequest, match="needs reasoning or tool calls"):
            r.render_sync(conv, GenerationOptions(thinking=thinking, continue_final=True))
        return
    out = r.render_sync(conv, GenerationOptions(thinking=thinking, continue_final=True))
    assert out.text.endswith("The file is"), f"{name}: {out.text[-200:]!r}"
    assert out.starts_in_reasoning is False
    assert "Write the file, refresh, store the blob." in out.text


def test_kimi_k3_takes_the_request_s_thinking_switch_and_effort_under_its_own_kwarg_names(tokenizer_path):
    """Its template reads `thinking` (not enable_thinking) and `thinking_effort` (low, medium, high, max): the
    request's switch and effort reach it under those names, an effort it has no value for leaves its default."""
    r = renderer(tokenizer_path, "kimi-k3")

    def effort_line(**opts) -> str | None:
        text = r.render_sync(base_conv(), GenerationOptions(**opts)).text
        at = text.find("invoked with `thinking_effort=")
        return text[at:].split("`")[1] if at >= 0 else None

    assert effort_line(thinking=True) == "thinking_effort=max"  # the template's default
    assert effort_line(thinking=True, reasoning_effort="medium") == "thinking_effort=medium"
    assert effort_line(thinking=True, reasoning_effort="xhigh") == "thinking_effort=max"
    assert effort_line(thinking=True, reasoning_effort="turbo") == "thinking_effort=max"  # no value: the default
    # Every effort the Responses API accepts with thinking on (Chat's and Anthropic's are among them) gets one of
    # the template's values; the nearest, never its default max for the least effort.
    efforts = typing.get_args(ReasoningParam.model_fields["effort"].annotation)[0]
    assert {e: effort_line(thinking=True, reasoning_effort=e) for e in typing.get_args(efforts) if e != "none"} == {
        "minimal": "thinking_effort=low", "low": "thinking_effort=low", "medium": "thinking_effort=medium",
        "high": "thinking_effort=high", "xhigh": "thinking_effort=max", "max": "thinking_effort=max"}
    off = r.render_sync(base_conv(), GenerationOptions(thinking=False, reasoning_effort="high"))
    assert effort_line(thinking=False) is None and not off.starts_in_reasoning
    assert off.text.endswith("<|open|>response<|sep|>")


def said(role: str, text: str) -> Message:
    return Message(role, [TextPart(text)])


def rendered_in_order(text: str, msgs: list[Message]) -> bool:
    """Every one-text message of `msgs` is in `text`, in the order sent."""
    at = [text.find(m.parts[0].text) for m in msgs]
    return min(at) >= 0 and at == sorted(at)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_system_message_renders_where_it_stands(tokenizer_path, name):
    """Codex sends its instructions and developer messages first and more developer messages later in a session;
    Chat clients may send several system messages. On every family's template each one renders, in order, and a
    later one where it stands (not hoisted into the head: the prompt before it is unchanged), also where the
    template takes a single system message only, first (ReplayPolicy.merge_leading_system, later_system_as_user)."""
    r = renderer(tokenizer_path, name)
    first = [said("system", "Base instructions."), said("developer", "Sandbox: workspace-write."),
             said("developer", "Approvals: on-request."), said("user", "List the files.")]
    answered = [*first, said("assistant", "Here they are.")]
    later = [*answered, said("developer", "Approvals: never."), said("user", "Delete the build folder.")]
    opts = GenerationOptions(thinking=False)
    history = r.render_text(Conversation(messages=answered), opts, add_generation_prompt=False)
    text = r.render_sync(Conversation(messages=later), opts).text
    assert rendered_in_order(text, later), text
    head = "List the files."
    assert text[:text.index(head)] == history[:history.index(head)]


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("name", FAMILIES)
def test_random_system_and_developer_messages_all_render_in_order(tokenizer_path, name, thinking):
    """Random sessions: one to three leading system/developer messages, then user and assistant turns with
    developer messages between them (as Codex inserts them), with tools, as agents send them (without, DeepSeek-V4
    drops developer messages before the last user turn by design: the catalog's limits). Every text renders, in the
    order sent, with thinking off and on (DeepSeek-V3.2's encoder fails on a developer message before the last user
    turn only in thinking mode)."""
    r = renderer(tokenizer_path, name)
    rng = random.Random(f"system-messages-{name}")
    for case in range(12):
        msgs = [said(rng.choice(["system", "developer"]), f"Lead {case}.{i}.") for i in range(rng.randint(1, 3))]
        for turn in range(rng.randint(1, 4)):
            if turn and rng.random() < 0.5:
                msgs += [said(rng.choice(["system", "developer"]), f"Later {case}.{turn}.{i}.")
                         for i in range(rng.randint(1, 2))]
            msgs.append(said("user", f"Question {case}.{turn}."))
            msgs.append(said("assistant", f"Answer {case}.{turn}."))
        msgs.pop()  # the request ends with the user's turn
        text = r.render_sync(Conversation(messages=msgs, tools=SCHEMAS), GenerationOptions(thinking=thinking)).text
        assert rendered_in_order(text, msgs), (case, [m.role for m in msgs], text)


def test_the_templates_that_take_one_system_message_first_are_found(tokenizer_path):
    """The probe's verdict on the real templates: Qwen3.5/3.6/3.8 raise on any system message but the first,
    MiniMax-M2 and M3 drop the others, gpt-oss drops a later one, DeepSeek-V3.1 hoists a later one into its head,
    DeepSeek-V3.2's encoder fails on a developer message before the last user message in thinking mode."""
    policies = {name: renderer(tokenizer_path, name).policy for name in FAMILIES}
    assert {n for n, p in policies.items() if p.merge_leading_system} == {"gpt-oss", "minimax-m2", "minimax-m3",
                                                                          "ministral-3", "qwen3.5", "qwen3.6",
                                                                          "qwen3.8"}
    assert {n for n, p in policies.items() if p.later_system_as_user} == {"deepseek-v3.1", "gpt-oss", "minimax-m2",
                                                                          "minimax-m3", "ministral-3", "qwen3.5",
                                                                          "qwen3.6", "qwen3.8"}
    # Templates that name the developer role get it, but for DeepSeek-V3.2 (a request that opens with one, as Codex
    # may, fails): its developer messages go in as system messages, which it writes where they stand.
    knows = {n for n in FAMILIES if decide_policy(get_family(n).template_text(), None).developer_role}
    assert {n for n in knows if not policies[n].developer_role} == {"deepseek-v3.2"}


def test_qwen3_8_takes_the_request_s_effort_as_one_of_its_three(tokenizer_path):
    """Its template writes an instruction for xhigh (its default) and low at the front of the system message,
    none for medium, and raises on any other value: every effort a request can name maps to one of the three."""
    r = renderer(tokenizer_path, "qwen3.8")

    def instruction(**opts) -> str | None:
        text = r.render_sync(base_conv(), GenerationOptions(**opts)).text
        assert text.startswith("<|im_start|>system\n")
        head = text[len("<|im_start|>system\n"):]
        return head.split(".")[0] if head.startswith("Reasoning effort is set to") else None

    assert instruction(thinking=True) == "Reasoning effort is set to xhigh"  # the template's default
    assert instruction(thinking=True, reasoning_effort="medium") is None
    assert instruction(thinking=True, reasoning_effort="turbo") == "Reasoning effort is set to xhigh"
    efforts = typing.get_args(ReasoningParam.model_fields["effort"].annotation)[0]
    assert {e: instruction(thinking=True, reasoning_effort=e) for e in typing.get_args(efforts) if e != "none"} == {
        "minimal": "Reasoning effort is set to low", "low": "Reasoning effort is set to low", "medium": None,
        "high": "Reasoning effort is set to xhigh", "xhigh": "Reasoning effort is set to xhigh",
        "max": "Reasoning effort is set to xhigh"}
    off = r.render_sync(base_conv(), GenerationOptions(thinking=False, reasoning_effort="low"))
    assert "Reasoning effort" not in off.text and off.text.endswith("<think>\n\n</think>\n\n")
    assert not off.starts_in_reasoning


@pytest.mark.parametrize("name", ["qwen3.6", "qwen3.8"])
def test_qwen3_6_and_3_8_keep_every_turn_s_reasoning_unless_the_request_says_otherwise(tokenizer_path, name):
    """Qwen3.6 keeps earlier reasoning only with preserve_thinking (the family sets it), Qwen3.8 by default; a
    request's own chat_template_kwargs still win (preserve_thinking false: only the current exchange's)."""
    r = renderer(tokenizer_path, name)
    conv = Conversation(messages=[said("user", "First question."),
                                  Message("assistant", [ReasoningPart("Old thought."), TextPart("Old answer.")]),
                                  said("user", "Second question.")])
    assert "Old thought." in r.render_sync(conv, GenerationOptions(thinking=True)).text
    dropped = r.render_sync(conv, GenerationOptions(thinking=True, chat_template_kwargs={"preserve_thinking": False}))
    assert "Old thought." not in dropped.text and "Old answer." in dropped.text


# -- user turns that do not alternate ----------------------------------------------------------------------------

def user_texts_in_order(text: str, msgs: list[Message]) -> bool:
    """Every user text and tool result of `msgs` is in `text`, in the order sent (what a template does with the
    assistant's own text is the catalog's business: Gemma 4 writes a call turn's text after its results)."""
    said_ = [p.content if isinstance(p, ToolResultPart) else p.text for m in msgs if m.role != "assistant"
             for p in m.parts if isinstance(p, (TextPart, ToolResultPart))]
    at = [text.find(t) for t in said_]
    return min(at) >= 0 and at == sorted(at)


def test_the_templates_whose_turns_must_alternate_are_found(tokenizer_path):
    """The probe's verdict on the real templates: Ministral 3 raises on two user turns in a row, and on user text
    right after tool results; every other family takes both as they are."""
    policies = {name: renderer(tokenizer_path, name).policy for name in FAMILIES}
    assert {n for n, p in policies.items() if p.merge_user_runs} == {"ministral-3"}
    assert {n for n, p in policies.items() if p.user_text_into_tool_result} == {"ministral-3"}


@pytest.mark.parametrize("name", FAMILIES)
def test_user_turns_that_do_not_alternate_render_in_order(tokenizer_path, name):
    """Random tool-loop sessions as agents send them: Codex opens with two or three user messages, Claude Code sends
    text beside its tool results, and a user may speak again before an answer (an interrupted turn). Every text
    and result renders, in the order sent, on every family (Ministral 3's template raises on both unless the
    text joins the user turn before it: ReplayPolicy.merge_user_runs, user_text_into_tool_result)."""
    r, fam = renderer(tokenizer_path, name), get_family(name)
    rng = random.Random(f"alternation-{name}")
    opts = GenerationOptions(thinking=False)
    for case in range(8):
        msgs = [said("system", f"System {case}.")]
        msgs += [said("user", f"Opening {case}.{i}.") for i in range(rng.randint(1, 3))]
        calls = 0
        for turn in range(rng.randint(1, 4)):
            if rng.random() < 0.6:
                cid = call_id(fam, "refresh", calls)
                calls += 1
                msgs.append(Message("assistant", [TextPart(f"Calling {case}.{turn}."),
                                                  ToolCallPart(cid, "refresh", "{}")]))
                results: list = [ToolResultPart(cid, f"Result {case}.{turn}.", name="refresh")]
                if rng.random() < 0.5:
                    results.append(TextPart(f"Beside {case}.{turn}."))
                msgs.append(Message("user", results))
                if rng.random() < 0.3:
                    msgs.append(said("user", f"Meanwhile {case}.{turn}."))
            else:
                msgs.append(said("assistant", f"Answer {case}.{turn}."))
                msgs += [said("user", f"Next {case}.{turn}.{i}.") for i in range(rng.randint(1, 2))]
        conv = Conversation(messages=msgs, tools=SCHEMAS)
        text = r.render_sync(conv, opts).text
        assert user_texts_in_order(text, msgs), (case, [m.role for m in msgs], text)




def test_only_ministral_3_needs_an_empty_answer_as_a_block(tokenizer_path):
    """The probe's verdict: Ministral 3's template raises on an assistant turn with neither text nor calls; every
    other family takes it as it is."""
    assert {n for n in FAMILIES if renderer(tokenizer_path, n).policy.empty_turn_as_blocks} == {"ministral-3"}


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("name", FAMILIES)
def test_an_answer_that_was_only_the_end_token_replays(tokenizer_path, name, thinking):
    """A model may answer with its end token alone. The next request carries that turn with neither text nor calls:
    it renders on every family (Ministral 3's template raised: a 400 for the whole session from then on), and on
    Ministral 3 the prompt before it is kept whole."""
    r = renderer(tokenizer_path, name)
    opts = GenerationOptions(thinking=thinking)
    first = [said("system", "Be brief."), said("user", "Say nothing.")]
    before = r.render_sync(Conversation(messages=first), opts).text
    for empty in (Message("assistant", []), said("assistant", "")):
        msgs = [*first, empty, said("user", "Now say something.")]
        after = r.render_sync(Conversation(messages=msgs), opts).text
        assert user_texts_in_order(after, msgs)
        if name == "ministral-3":
            assert after.startswith(before + r.tokenizer.eos_token), after


@pytest.mark.parametrize("name", ["deepseek-v4", "deepseek-v4.1"])
def test_deepseek_v4_takes_every_effort_a_request_can_name(tokenizer_path, name):
    """The effort is a preamble at the head of the prompt (V4: none, "absolute maximum" or "beyond maximum"; V4.1: a
    number). vLLM's V4.1 encoder refuses minimal and medium: the catalog maps them (low, high), so no request that
    names an effort is refused."""
    r = renderer(tokenizer_path, name)

    def head(**opts) -> str:
        text = r.render_sync(base_conv(), GenerationOptions(**opts)).text
        return text.split("\n")[0].replace("<｜begin▁of▁sentence｜>", "").replace("<｜System｜>", "")

    efforts = typing.get_args(typing.get_args(ReasoningParam.model_fields["effort"].annotation)[0])
    got = {e: head(thinking=True, reasoning_effort=e) for e in efforts if e != "none"}
    if name == "deepseek-v4":
        high, top = "Reasoning Effort: Absolute maximum", "Reasoning Effort: Beyond maximum"
        assert {e: h[:len(high)] if h.startswith(high) else h[:len(top)] if h.startswith(top) else ""
                for e, h in got.items()} == {"minimal": "", "low": "", "medium": "", "high": high, "xhigh": high,
                                              "max": top}
    else:
        assert {e: h.split(" (")[0] for e, h in got.items()} == {
            "minimal": "Reasoning Effort: 50", "low": "Reasoning Effort: 50", "medium": "Reasoning Effort: 75",
            "high": "Reasoning Effort: 75", "xhigh": "Reasoning Effort: 75", "max": "Reasoning Effort: 100"}
    default = head(thinking=True)
    assert default.startswith("Reasoning Effort: Absolute maximum" if name == "deepseek-v4" else "Reasoning Effort: 75")
    off = r.render_sync(base_conv(), GenerationOptions(thinking=False, reasoning_effort="high"))
    assert "Reasoning Effort" not in off.text and off.text.endswith("<｜Assistant｜></think>")
