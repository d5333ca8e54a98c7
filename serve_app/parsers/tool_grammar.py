"""`tool_choice` as a grammar: the structural tag (xgrammar's, passed through vLLM's `structured_outputs`) that lets
the model write only what the request's tool choice allows, in the model's own tool-call format.

The calls stay in the family's wire format, so the same parser reads them and the assistant turn renders back into
the next prompt byte for byte (docs/architecture.md, "prefix stability"); vLLM's own server instead switches
forced calls to a JSON list the model never writes unforced.

- `none`: the format's call markers cannot be written (the tools stay in the prompt, so the cached prefix of a
  session does not change with the choice);
- `required` / named: the answer is calls and only calls (the vendors' forced calls have no text before them),
  with arguments valid against each tool's schema; named: exactly one call of that tool;
- `auto` with parallel calls off: free text, then at most one call, schema-valid;
- `allowed` (OpenAI's `allowed_tools`, with `auto` or `required`): as above, but only the listed tools' calls can be
  written (the others stay in the prompt);
- `auto` otherwise: no grammar.

A thinking model reasons first: when vLLM's own reasoning gate holds the grammar back until the think block ends
(`reasoning_gate`), the tag starts at the answer; without a gate the tag carries the think block itself.

The shapes are data, one row per tool format (`SHAPES`, keyed like `formats.TOOL_PARSERS`); the writing matches
the templates in serve_app/families, which the parsers read back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from serve_app.conversation import ToolChoice, ToolSpec
from serve_app.parsers.element_grammar import element_arguments
from serve_app.parsers.formats import REASONING_PARSERS, TOOL_PARSERS
from serve_app.parsers.gemma4_grammar import gemma_arguments
from serve_app.parsers.pythonic_grammar import keyword_arguments
from serve_app.parsers.xtml_grammar import xtml_arguments, xtml_attr


@dataclass(frozen=True, slots=True)
class CallShape:
    """How one tool format writes calls. `call_begin` holds `{name}`; `args` is xgrammar's JSON-schema style
    ("json", "qwen_xml", "minimax_xml", "deepseek_xml", "deepseek_v4_1_xml", "glm_xml"), "python" (keyword
    arguments, Python literals: pythonic_grammar.py), "gemma" (Gemma 4's notation: gemma4_grammar.py), "xtml"
    (Kimi K3's typed argument elements: xtml_grammar.py) or "elements" (MiniMax-M3's argument elements, nested:
    element_grammar.py)."""

    call_begin: str
    call_end: str
    args: str = "json"
    triggers: tuple[str, ...] = ()  # a prefix of every call (or section) begin
    separator: str = "\n"  # between calls of one answer
    section_begin: str | None = None  # calls sit inside one section
    section_end: str | None = None
    index_regex: str | None = None  # after call_begin, before args_begin: a call index (Kimi's `:0`)
    args_begin: str = ""
    # Forced calls: what the answer writes before them, (an opener the prompt may already have written, its
    # close): Kimi K3's empty response channel, which its template renders in front of every call section
    forced_lead: tuple[str, str] | None = None
    none_excludes: tuple[str, ...] | None = None  # what `none` forbids; None: the triggers


_HERMES = CallShape('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", triggers=("<tool_call>",))
_QWEN_XML = CallShape("<tool_call>\n<function={name}>\n", "</function>\n</tool_call>", args="qwen_xml",
                      triggers=("<tool_call>",), none_excludes=("<tool_call>", "<function="))
_GLM = CallShape("<tool_call>{name}\n", "</tool_call>", args="glm_xml", triggers=("<tool_call>",))
_DS_SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
_WRAP = '{{"name": "{name}", "arguments": '  # a JSON wrapper up to its arguments
_LIST_IN_TOOL_CALLS = CallShape(_WRAP, "}", separator=", ", section_begin="<tool_calls>[", section_end="]</tool_calls>",
                                triggers=("<tool_calls>",))


def _dsml(outer: str, sep: str = "", style: str = "deepseek_xml") -> CallShape:
    d = "｜DSML｜" + sep  # V4.1 writes a space after the marker in every tag
    return CallShape(f'<{d}invoke name="{{name}}">\n', f"</{d}invoke>\n", args=style,
                     section_begin=f"<{d}{outer}>\n", section_end=f"</{d}{outer}>", separator="",
                     triggers=(f"<{d}{outer}>",))


_MM3 = TOOL_PARSERS["minimax_m3"].ns  # MiniMax-M3's namespace marker, in front of every structural tag
_PYTHONIC = CallShape("{name}(", ")", args="python", section_begin="[", section_end="]", separator=", ",
                      triggers=("[",), none_excludes=())

SHAPES: dict[str, CallShape] = {
    "hermes": _HERMES,
    "qwen3_json": _HERMES,
    "qwen3_coder": _QWEN_XML,
    "qwen3_xml": _QWEN_XML,
    "nemotron_nano": _QWEN_XML,
    "step3p5": _QWEN_XML,
    "seed_oss": CallShape("<seed:tool_call>\n<function={name}>\n", "</function>\n</seed:tool_call>", args="qwen_xml",
                          triggers=("<seed:tool_call>",)),
    "longcat": CallShape('<longcat_tool_call>\n{{"name": "{name}", "arguments": ', "}\n</longcat_tool_call>",
                         triggers=("<longcat_tool_call>",)),
    "llama3_json": CallShape('{{"name": "{name}", "parameters": ', "}", separator="; ", triggers=('{"name"',)),
    "mistral": CallShape("[TOOL_CALLS]{name}[ARGS]", "", separator="", triggers=("[TOOL_CALLS]",)),
    "deepseek_v3": CallShape("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n", "\n```<｜tool▁call▁end｜>",
                             section_begin=_DS_SECTION[0], section_end=_DS_SECTION[1], triggers=(_DS_SECTION[0],)),
    "deepseek_v31": CallShape("<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>", "<｜tool▁call▁end｜>", separator="",
                              section_begin=_DS_SECTION[0], section_end=_DS_SECTION[1], triggers=(_DS_SECTION[0],)),
    "deepseek_v32": _dsml("function_calls"),
    "deepseek_v4": _dsml("tool_calls"),
    "deepseek_v41": _dsml("calls", sep=" ", style="deepseek_v4_1_xml"),
    "kimi_k2": CallShape("<|tool_call_begin|>functions.{name}:", "<|tool_call_end|>", separator="",
                         index_regex=r"\d+", args_begin="<|tool_call_argument_begin|>",
                         section_begin="<|tool_calls_section_begin|>", section_end="<|tool_calls_section_end|>",
                         triggers=("<|tool_calls_section_begin|>",),
                         none_excludes=("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>",
                                        "<|tool_call_begin|>")),
    "glm45": _GLM,
    "glm47": _GLM,
    "minimax_m2": CallShape('<invoke name="{name}">\n', "</invoke>\n", args="minimax_xml", separator="",
                            section_begin="<minimax:tool_call>\n", section_end="</minimax:tool_call>",
                            triggers=("<minimax:tool_call>",)),
    "minimax_m3": CallShape(_MM3 + '<invoke name="{name}">', _MM3 + "</invoke>\n", args="elements", separator="",
                            section_begin=_MM3 + "<tool_call>\n", section_end=_MM3 + "</tool_call>",
                            triggers=(_MM3 + "<tool_call>",)),
    "minimax": CallShape(_WRAP, "}\n", separator="", section_begin="<tool_calls>\n", section_end="</tool_calls>",
                         triggers=("<tool_calls>",)),
    "hunyuan_a13b": _LIST_IN_TOOL_CALLS,
    "jamba": _LIST_IN_TOOL_CALLS,
    # xLAM and Granite also read a list that opens the answer without a marker: `none` forbids that list's start
    "xlam": CallShape(_WRAP, "}", separator=", ", section_begin="<tool_call>[", section_end="]</tool_call>",
                      triggers=("<tool_call>",), none_excludes=("<tool_call>", "[TOOL_CALLS]", "```json", '[{"name"')),
    "granite": CallShape(_WRAP, "}", separator=", ", section_begin="<|tool_call|>[", section_end="]",
                         triggers=("<|tool_call|>",), none_excludes=("<|tool_call|>", "<tool_call>", '[{"name"')),
    "granite4": CallShape("<tool_call>" + _WRAP, "}</tool_call>", triggers=("<tool_call>",)),
    "granite-20b-fc": CallShape("<function_call> " + _WRAP, "}", triggers=("<function_call>",)),
    "internlm2": CallShape('<|action_start|><|plugin|>{{"name": "{name}", "parameters": ', "}<|action_end|>",
                           triggers=("<|action_start|>",)),
    "ernie45": _HERMES,
    "gigachat3": CallShape("<|message_sep|>\n\nfunction call<|role_sep|>\n" + _WRAP, "}", separator="",
                           triggers=("<|message_sep|>",), none_excludes=("<|message_sep|>", "<|function_call|>")),
    "hy_v3": CallShape("<tool_call>{name}<tool_sep>", "</tool_call>", args="glm_xml", separator="",
                       section_begin="<tool_calls>", section_end="</tool_calls>", triggers=("<tool_calls>",)),
    # Harmony: a call is its own commentary message, which ends the turn (`<|call|>` stops generation), so one call
    # per answer; `none` forbids addressing a function.
    "openai": CallShape("<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>", "<|call|>",
                        triggers=("<|channel|>commentary to=",), separator="", none_excludes=("to=functions.",)),
    # Pythonic: Python call syntax has no xgrammar style; pythonic_grammar.py writes an EBNF grammar per tool.
    # OLMo 3 writes its calls one per line in <function_calls> (the grammar writes Python's literals, also read)
    "pythonic": _PYTHONIC,
    "llama4_pythonic": _PYTHONIC,  # the bare list (its <|python_start|> wrapper is optional)
    "phi4_mini_json": CallShape('{{"name": "{name}", "arguments": ', "}", section_begin="functools[", section_end="]",
                                separator=", ", triggers=("functools[",)),
    "olmo3": CallShape("{name}(", ")", args="python", section_begin="<function_calls>",
                       section_end="</function_calls>", triggers=("<function_calls>",)),
    # Gemma 4: its own notation, no xgrammar style either (gemma4_grammar.py); calls follow each other unseparated
    "gemma4": CallShape("<|tool_call>call:{name}{{", "}<tool_call|>", args="gemma", separator="",
                        triggers=("<|tool_call>",)),
    # Kimi K3: a call's index counts up within the section (the grammar lets any number stand); forced calls
    # follow the empty response channel the template writes before them
    "kimi_k3": CallShape('<|open|>call tool="{name}" index="', "<|close|>call<|sep|>", args="xtml", separator="",
                         index_regex=r"[0-9]{1,3}", args_begin='"<|sep|>',
                         section_begin="<|open|>tools<|sep|>", section_end="<|close|>tools<|sep|>",
                         triggers=("<|open|>tools<|sep|>",),
                         forced_lead=("<|open|>response<|sep|>", "<|close|>response<|sep|>")),
}
_ARG_GRAMMARS = {"python": keyword_arguments, "gemma": gemma_arguments, "xtml": xtml_arguments,  # written here
                 "elements": lambda schema: element_arguments(schema, _MM3)}

_HARMONY_ANALYSIS = ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant")
_TRIVIAL = {"type": "object", "properties": {}}


def _args_schema(tool: ToolSpec) -> dict[str, Any] | bool:
    params = tool.parameters or _TRIVIAL
    return params if isinstance(params, dict) else True


def _call_tag(shape: CallShape, tool: ToolSpec) -> dict[str, Any]:
    if shape.args in _ARG_GRAMMARS:
        args: dict[str, Any] = _ARG_GRAMMARS[shape.args](_args_schema(tool)) or {"type": "const_string", "value": ""}
    else:
        args = {"type": "json_schema", "json_schema": _args_schema(tool), "style": shape.args}
    parts: list[dict[str, Any]] = []
    if shape.index_regex:
        parts.append({"type": "regex", "pattern": shape.index_regex})
    if shape.args_begin:
        parts.append({"type": "const_string", "value": shape.args_begin})
    content = {"type": "sequence", "elements": [*parts, args]} if parts else args
    name = xtml_attr(tool.name) if shape.args == "xtml" else tool.name
    return {"type": "tag", "begin": shape.call_begin.format(name=name), "content": content, "end": shape.call_end}


def _calls(shape: CallShape, tools: list[ToolSpec], *, forced: bool, one: bool) -> dict[str, Any]:
    """The tool part of the answer. Forced: calls only, at least one. Otherwise: text with calls in it; the text
    cannot hold the call markers the triggers do not catch (a bare `<function=` that the parser would read as a
    call of any tool)."""
    tags = [_call_tag(shape, t) for t in tools]
    if shape.section_begin is not None:
        inner = {"type": "tags_with_separator", "tags": tags, "separator": shape.separator,
                 "at_least_one": True, "stop_after_first": one}
        section = {"type": "tag", "begin": shape.section_begin, "content": inner, "end": shape.section_end}
        if forced:
            return section
        tags, one = [section], True  # one section holds every call
    elif forced:
        return {"type": "tags_with_separator", "tags": tags, "separator": shape.separator,
                "at_least_one": True, "stop_after_first": one}
    text: dict[str, Any] = {"type": "triggered_tags", "triggers": list(shape.triggers), "tags": tags,
                            "stop_after_first": one}
    stray = [e for e in (shape.none_excludes or ()) if e not in shape.triggers]
    if stray:
        text["excludes"] = stray
    return text


def _reasoning_prefix(reasoning: str | None, starts_in_reasoning: bool, gated: bool) -> dict[str, Any] | None:
    fmt = REASONING_PARSERS.get(reasoning) if reasoning else None
    if fmt is None or fmt.harmony or gated:
        return None
    if starts_in_reasoning:  # the prompt opened the think block: the answer begins inside it
        return {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": fmt.end}
    # the model may think first, or not
    return {"type": "optional", "content": {"type": "tag", "begin": fmt.start, "content": {"type": "any_text"},
                                            "end": fmt.end}}


def structural_tag(
    tool_format: str | None,
    tools: list[ToolSpec],
    choice: ToolChoice,
    *,
    reasoning: str | None = None,
    starts_in_reasoning: bool = False,
    reasoning_gate: bool = False,
) -> dict[str, Any] | None:
    """The structural tag enforcing `choice`, or None where nothing needs enforcing (or the format has no shape:
    `tool_format` unknown). The caller checked that a named tool exists."""
    shape = SHAPES.get(tool_format or "")
    if shape is None or not tools:
        return None
    harmony = tool_format == "openai"
    callable_ = tools if choice.allowed is None else [t for t in tools if t.name in choice.allowed]
    if choice.mode == "none" or (choice.mode == "auto" and not callable_):
        excludes = list(shape.triggers if shape.none_excludes is None else shape.none_excludes)
        if not excludes:
            return None
        body: dict[str, Any] = {"type": "any_text", "excludes": excludes}
    elif choice.mode in ("required", "tool"):
        chosen = [t for t in tools if t.name == choice.name] if choice.mode == "tool" else callable_
        body = _calls(shape, chosen, forced=True, one=choice.mode == "tool" or not choice.parallel or harmony)
        if shape.forced_lead is not None:
            opener, close = shape.forced_lead
            body = {"type": "sequence", "elements": [
                {"type": "optional", "content": {"type": "const_string", "value": opener}},
                {"type": "const_string", "value": close}, body]}
    elif not choice.parallel or len(callable_) < len(tools):
        body = _calls(shape, callable_, forced=False, one=not choice.parallel)
    else:
        return None
    elements: list[dict[str, Any]] = []
    if harmony:
        if reasoning_gate:
            return None  # vLLM's gpt-oss gate opens only at the final channel, after any call: nothing to enforce
        elements.append({"type": "optional", "content": {"type": "tag", "begin": _HARMONY_ANALYSIS[0],
                                                         "content": {"type": "any_text"}, "end": _HARMONY_ANALYSIS[1]}})
    else:
        prefix = _reasoning_prefix(reasoning, starts_in_reasoning, reasoning_gate)
        if prefix is not None:
            elements += [prefix, {"type": "regex", "pattern": r"\s{0,4}"}]  # the blank line after </think>
    fmt = {"type": "sequence", "elements": [*elements, body]} if elements else body
    return {"type": "structural_tag", "format": fmt}


def engine_constraint(tag: dict[str, Any]) -> dict[str, Any]:
    """vLLM StructuredOutputsParams fields for a structural tag (vLLM takes it as a JSON string)."""
    return {"structural_tag": json.dumps(tag, ensure_ascii=False, separators=(",", ":"))}


def check_choice(choice: ToolChoice, tools: list[ToolSpec]) -> str | None:
    """What is wrong with a tool choice given the tools, as the 400's message, or None."""
    names = {t.name for t in tools}
    if choice.mode == "tool" and choice.name not in names:
        return f"tool_choice names tool {choice.name!r}, which is not in tools"
    if choice.mode in ("required", "tool") and not tools:
        return "tool_choice requires a tool call, but no tools were given"
    if choice.allowed is not None:
        missing = [n for n in choice.allowed if n not in names]
        if missing:
            return f"tool_choice allows tool {missing[0]!r}, which is not in tools"
        if choice.mode == "required" and not choice.allowed:
            return "tool_choice requires a call of one of its allowed tools, but it allows none that the model is given"
    return None



