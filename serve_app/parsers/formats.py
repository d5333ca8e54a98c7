"""The formats, as data. Names follow vLLM's `--reasoning-parser` / `--tool-call-parser`, so configs carry over.

Each reasoning format is a pair of think markers (or Harmony); each tool format is a descriptor for one of six
engines (JSON-in-tags, XML function/parameter, XML argument elements, pythonic, Gemma 4's notation, Harmony) and declares it:
`fmt.engine(schemas)` builds the per-request engine, and `fmt.harmony` says the format parses the whole stream
instead. Adding a model family is adding a row here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from serve_app.parsers.gemma4 import Gemma4Format
from serve_app.parsers.json_tags import JsonTagsFormat
from serve_app.parsers.pythonic import PythonicFormat
from serve_app.parsers.xml_elements import ElementFormat
from serve_app.parsers.xml_tags import XmlFormat, dsml_param, xtml_name, xtml_param


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    starts_in_reasoning: bool = False  # the model's template opens the think block in the prompt
    tool_ends_reasoning: bool = False  # a tool-call section closes the think block (no end marker follows)
    # Without a tool parser: the family's tool-call markers still end reasoning and stay as text (vLLM's reasoning
    # parsers do this; with a tool parser the format's own markers make it a call)
    ends_at: tuple[str, ...] = ()
    special_tokens: bool = False
    harmony: bool = False
    # Step-3.5 writes a newline on each side of the end marker: one "\n" right before it is not reasoning and one
    # right after it is not content (vLLM's step3p5 parser trims them the same way); with `answer` tags, one "\n"
    # on each side of a tag is padding too
    trim_end_newlines: bool = False
    # other spellings of the markers the model writes (Granite: "Here's" as well as "Here is")
    start_alts: tuple[str, ...] = ()
    end_alts: tuple[str, ...] = ()
    # the tags the answer after the think block is wrapped in (Hunyuan's <answer>, ERNIE's <response>, Kimi K3's
    # response channel and the close of its message): markup in text, dropped
    answer: tuple[str, ...] | None = None
    # the think block is the client's to parse (MiniMax-M2 "append think"): nothing is split off as reasoning, the
    # markers stay in the text, and a start marker the prompt opened is put back in front of the output
    as_content: bool = False
    # Gemma 4 opens its block as `<|channel>thought\n`: the role label right after the start marker is markup,
    # dropped when it is there whole (vLLM's gemma4 parser strips it too); text that only begins like it is kept
    start_label: str = ""
    # thinking off, a turn that is only reasoning gives it again as the answer (parsers/answer.py; vLLM's
    # nemotron_v3 parser does this), as a request's force_nonempty_content does for every format
    answer_when_thinking_off: bool = False
    # a stray end marker is markup only where it opens the output (MiniMax-M3's template writes a bare one in front
    # of a turn without reasoning); one after the output began is text, as vLLM's minimax_m3 parser keeps it
    late_end_is_text: bool = False


@dataclass(frozen=True, slots=True)
class HarmonyFormat:
    """Harmony is not an engine inside the think-tag composite: its channels carry the reasoning too, so it
    parses the whole stream (`harmony.HarmonyParser`) in place of `stream.StreamParser`."""

    name: str
    special_tokens: bool = True
    starts: tuple[str, ...] = ()
    harmony: ClassVar[bool] = True


_THINK = ("<think>", "</think>")
_KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")


def _xtml(tag: str) -> tuple[str, str]:
    """Kimi K3's XTML element markers: <|open|>TAG<|sep|> ... <|close|>TAG<|sep|> (three special tokens each)."""
    return f"<|open|>{tag}<|sep|>", f"<|close|>{tag}<|sep|>"

REASONING_PARSERS: dict[str, ReasoningFormat] = {
    r.name: r
    for r in (
        ReasoningFormat("qwen3", *_THINK, ends_at=("<tool_call>",)),
        ReasoningFormat("deepseek_r1", *_THINK, starts_in_reasoning=True),
        ReasoningFormat("deepseek_v3", *_THINK),
        ReasoningFormat("nemotron_deci", *_THINK),
        ReasoningFormat("nemotron_v3", *_THINK, starts_in_reasoning=True, answer_when_thinking_off=True),
        ReasoningFormat("glm45", *_THINK, special_tokens=True),
        ReasoningFormat("glm47", *_THINK, special_tokens=True),
        ReasoningFormat("kimi_k2", *_THINK, tool_ends_reasoning=True, special_tokens=True, ends_at=_KIMI_SECTION),
        ReasoningFormat("kimi_k25", *_THINK, starts_in_reasoning=True, tool_ends_reasoning=True,
                        special_tokens=True, ends_at=_KIMI_SECTION),
        # Kimi K3 (XTML): think channel, then the answer in a response channel, calls in a tools channel, and the
        # assistant message's own close before the end-of-message token; the prompt opens think (or, thinking off,
        # response)
        ReasoningFormat("kimi_k3", *_xtml("think"), starts_in_reasoning=True, special_tokens=True,
                        answer=(*_xtml("response"), _xtml("message")[1]), ends_at=(_xtml("tools")[0],)),
        ReasoningFormat("minimax_m2", *_THINK, starts_in_reasoning=True, tool_ends_reasoning=True,
                        special_tokens=True),
        # MiniMax-M3: the prompt opens <mm:think> only with thinking_mode "enabled" (adaptive, the default, opens
        # nothing; "disabled" closes it), and a turn rendered without reasoning starts with a bare </mm:think>
        ReasoningFormat("minimax_m3", "<mm:think>", "</mm:think>", special_tokens=True, late_end_is_text=True),
        ReasoningFormat("step3", *_THINK, starts_in_reasoning=True),
        ReasoningFormat("step3p5", *_THINK, starts_in_reasoning=True, trim_end_newlines=True),
        ReasoningFormat("seed_oss", "<seed:think>", "</seed:think>", starts_in_reasoning=True, special_tokens=True),
        ReasoningFormat("olmo3", *_THINK, starts_in_reasoning=True),
        # Hunyuan-A13B: "<think>\n…\n</think>\n<answer>\n…\n</answer>", newlines part of its marker tokens
        ReasoningFormat("hunyuan_a13b", "<think>\n", "\n</think>\n", answer=("<answer>\n", "\n</answer>")),
        # ERNIE-4.5: "abc\n</think>\n\n<response>\ndef\n</response>\n" or "abc\n</think>\ndef"
        ReasoningFormat("ernie45", *_THINK, starts_in_reasoning=True, trim_end_newlines=True,
                        answer=("<response>", "</response>")),
        # Granite 3.x: plain-text section headers, not tokens
        ReasoningFormat("granite", "Here is my thought process:", "Here is my response:",
                        start_alts=("Here's my thought process:",), end_alts=("Here's my response:",)),
        # Hy3 thinks only when asked (chat_template_kwargs reasoning_effort other than "no_think"; the prompt then
        # opens the block); Holo2 thinks unless told not to (chat_template_kwargs thinking=False)
        ReasoningFormat("hy_v3", *_THINK),
        ReasoningFormat("holo2", *_THINK, starts_in_reasoning=True),
        ReasoningFormat("minimax_m2_append_think", *_THINK, starts_in_reasoning=True, special_tokens=True,
                        as_content=True),
        ReasoningFormat("deepseek_v4", *_THINK, tool_ends_reasoning=True),
        ReasoningFormat("deepseek_v41", *_THINK, tool_ends_reasoning=True),
        ReasoningFormat("mistral", "[THINK]", "[/THINK]", special_tokens=True),
        # a tool call ends Gemma 4's thinking (vLLM's is_reasoning_end says so at <|tool_call>)
        ReasoningFormat("gemma4", "<|channel>", "<channel|>", tool_ends_reasoning=True, ends_at=("<|tool_call>",),
                        special_tokens=True, start_label="thought\n"),
        ReasoningFormat("gpt_oss", "<|channel|>analysis<|message|>", "<|end|>", special_tokens=True, harmony=True),
    )
}
REASONING_PARSERS["openai_gptoss"] = REASONING_PARSERS["gpt_oss"]


# -- tool formats ---------------------------------------------------------------------------------------------------

_DS_SEP = "<｜tool▁sep｜>"
_KIMI_ID = re.compile(r"^\s*((?:functions\.)?([\w.\-]+):\d+)\s*$")  # functions.NAME:IDX, the only form K2 writes


def _deepseek_v3_name(head: str) -> tuple[str, None] | None:
    # function<｜tool▁sep｜>NAME\n```json   (head_end is the ```json fence)
    name = head.split(_DS_SEP, 1)[-1].strip()
    return (name, None) if name else None


def _kimi_name(head: str) -> tuple[str, str | None] | None:
    m = _KIMI_ID.match(head)
    return (m.group(2), m.group(1)) if m else None  # a head without its :IDX is not a call (vLLM skips it too)


_NAME = re.compile(r"[\w.\-]+")


def _plain_name(head: str) -> tuple[str, None] | None:
    name = head.strip()
    return (name, None) if _NAME.fullmatch(name) else None


_MISTRAL_HEAD = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*([\w\-]+)\s*)?")


def _mistral_name(head: str) -> tuple[str, str | None] | None:
    # NAME  |  NAME[CALL_ID]ID  (v11+; the id is kept: the template renders it back)
    m = _MISTRAL_HEAD.fullmatch(head)
    return (m.group(1), m.group(2)) if m else None


_HERMES = JsonTagsFormat("hermes", starts=("<tool_call>",), call_end="</tool_call>")
_DSML = "｜DSML｜"


def _dsml(name: str, outer: str, sep: str = "") -> XmlFormat:
    """DeepSeek's DSML calls; V4.1 writes a space after the DSML marker in every tag (`<｜DSML｜ invoke ...>`)."""
    dsml = _DSML + sep
    return XmlFormat(
        name, starts=(f"<{dsml}{outer}>",), section_end=f"</{dsml}{outer}>",
        func_open=f"<{dsml}invoke name=", func_head_end=">", func_close=f"</{dsml}invoke>",
        param_open=f"<{dsml}parameter", param_head_end=">", value_close=f"</{dsml}parameter>",
        param_of=dsml_param, unwrap_params=("arguments", "input"))


_QWEN3_XML = XmlFormat(  # a bare <function=...> without <tool_call> is a call too (the models do write it)
    "qwen3_coder", starts=("<tool_call>", "<function="), section_end="</tool_call>",
    func_open="<function=", func_head_end=">", func_close="</function>",
    param_open="<parameter=", param_head_end=">", value_close="</parameter>",
    implicit_closes=("<parameter=", "</function>"))

_GLM = XmlFormat(
    "glm47", starts=("<tool_call>",), section_end="</tool_call>",
    func_open=None, func_head_end="", func_close=None,
    param_open="<arg_key>", param_head_end="</arg_key>", value_open="<arg_value>", value_close="</arg_value>",
    special_tokens=True)

TOOL_PARSERS: dict[str, object] = {
    "hermes": _HERMES,
    "qwen3_json": _HERMES,
    "qwen3_coder": _QWEN3_XML,
    "qwen3_xml": _QWEN3_XML,
    "nemotron_nano": _QWEN3_XML,
    "step3p5": _QWEN3_XML,  # Step-3.5 writes Qwen3-Coder's XML calls
    "seed_oss": XmlFormat(
        "seed_oss", starts=("<seed:tool_call>",), section_end="</seed:tool_call>",
        func_open="<function=", func_head_end=">", func_close="</function>",
        param_open="<parameter=", param_head_end=">", value_close="</parameter>",
        implicit_closes=("<parameter=", "</function>"), think=("<seed:think>", "</seed:think>"),
        special_tokens=True),
    "longcat": JsonTagsFormat("longcat", starts=("<longcat_tool_call>",), call_end="</longcat_tool_call>"),
    # a call opens the text with `{`, follows <|python_tag|>, or follows prose as `{"name"` (vLLM finds it there)
    "llama3_json": JsonTagsFormat("llama3_json", starts=("<|python_tag|>", '{"name"'), inline_starts=('{"name"',),
                                  list_sep=";", bare_start="{", name_only_call=False, special_tokens=True),
    # [TOOL_CALLS] then a JSON list of wrappers (pre-v11), NAME[ARGS]{..} or NAME{..} (v11, [ARGS] may be decoded
    # away), or NAME[CALL_ID]ID[ARGS]{..} (Devstral-class)
    "mistral": JsonTagsFormat("mistral", starts=("[TOOL_CALLS]",), head_end="[ARGS]", name_of=_mistral_name,
                              head_grammar=r"\s*[\w.\-]+\s*(?:\[CALL_ID\]\s*[\w\-]+\s*)?", args_end_head=True,
                              mistral_list=True, special_tokens=True),
    "deepseek_v3": JsonTagsFormat(
        "deepseek_v3", starts=("<｜tool▁calls▁begin｜>",), section_end="<｜tool▁calls▁end｜>",
        call_start="<｜tool▁call▁begin｜>", call_end="<｜tool▁call▁end｜>", head_end="```json",
        name_of=_deepseek_v3_name, head_grammar=r"\s*\w*<｜tool▁sep｜>\s*[\w.\-]+\s*", special_tokens=True),
    "deepseek_v31": JsonTagsFormat(
        "deepseek_v31", starts=("<｜tool▁calls▁begin｜>",), section_end="<｜tool▁calls▁end｜>",
        call_start="<｜tool▁call▁begin｜>", call_end="<｜tool▁call▁end｜>", head_end=_DS_SEP,
        name_of=_plain_name, head_grammar=r"\s*[\w.\-]+\s*", special_tokens=True),
    "deepseek_v32": _dsml("deepseek_v32", "function_calls"),
    "deepseek_v4": _dsml("deepseek_v4", "tool_calls"),
    "deepseek_v41": _dsml("deepseek_v41", "calls", sep=" "),
    "kimi_k2": JsonTagsFormat(
        "kimi_k2", starts=("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"),
        section_end="<|tool_calls_section_end|>", call_start="<|tool_call_begin|>", call_end="<|tool_call_end|>",
        head_end="<|tool_call_argument_begin|>", name_of=_kimi_name,
        head_grammar=r"\s*(?:functions\.)?[\w.\-]+:\d+\s*", special_tokens=True),
    "glm45": _GLM,
    "glm47": _GLM,
    # Kimi K3: <|open|>tools<|sep|>, then per call <|open|>call tool="N" index="I"<|sep|>, per argument
    # <|open|>argument key="K" type="T"<|sep|>V<|close|>argument<|sep|> (a string's raw text, any other type JSON)
    "kimi_k3": XmlFormat(
        "kimi_k3", starts=(_xtml("tools")[0],), section_end=_xtml("tools")[1],
        func_open="<|open|>call", func_head_end="<|sep|>", func_close=_xtml("call")[1],
        param_open="<|open|>argument", param_head_end="<|sep|>", value_close=_xtml("argument")[1],
        name_of=xtml_name, param_of=xtml_param, value_newlines=False, special_tokens=True,
        markup=(*_xtml("response"), _xtml("message")[1]), json_block=("<|open|>json", _xtml("json")[1])),
    "minimax_m2": XmlFormat(
        "minimax_m2", starts=("<minimax:tool_call>",), section_end="</minimax:tool_call>",
        func_open="<invoke name=", func_head_end=">", func_close="</invoke>",
        param_open="<parameter name=", param_head_end=">", value_close="</parameter>", undescribed_string=True,
        special_tokens=True),
    # MiniMax-M3: every structural tag prefixed by its namespace marker; arguments are elements named after them,
    # nested for objects and arrays (xml_elements.py)
    "minimax_m3": ElementFormat("minimax_m3", ns="]<]minimax[>["),
    # Phi-4-mini (vLLM's template): `functools` then a JSON list of {"name", "arguments"} wrappers; the marker is
    # plain text, not a special token
    "phi4_mini_json": JsonTagsFormat("phi4_mini_json", starts=("functools",), mistral_list=True,
                                     name_only_call=False),
    # MiniMax-M1: <tool_calls>, one {"name", "arguments"} wrapper per line, </tool_calls> (not minimax_m2's XML);
    # a malformed line is skipped, the calls after it stand
    "minimax": JsonTagsFormat("minimax", starts=("<tool_calls>",), section_end="</tool_calls>", call_start="{",
                              call_end="\n", inline_starts=("{",), name_only_call=False, think=_THINK),
    # <tool_calls>[wrapper, ...]</tool_calls>
    "hunyuan_a13b": JsonTagsFormat("hunyuan_a13b", starts=("<tool_calls>",), section_end="</tool_calls>",
                                   json_list=True, think=_THINK),
    "jamba": JsonTagsFormat("jamba", starts=("<tool_calls>",), section_end="</tool_calls>", json_list=True,
                            special_tokens=True),
    # Granite 3.x: <|tool_call|> (3.0's token) or <tool_call> (3.1's text), or nothing, then a JSON list
    "granite": JsonTagsFormat("granite", starts=("<|tool_call|>", "<tool_call>"), bare_start="[", json_list=True),
    # xLAM: a JSON list of wrappers opening the answer (or right after the think block), after [TOOL_CALLS], or
    # inside <tool_call>…</tool_call> or a ```json fence
    "xlam": JsonTagsFormat("xlam", starts=("[TOOL_CALLS]", "<tool_call>", "```json"), bare_start="[", json_list=True,
                           closes=(("<tool_call>", "</tool_call>"), ("```json", "```")), think=_THINK),
    "granite4": JsonTagsFormat("granite4", starts=("<tool_call>",), call_end="</tool_call>", special_tokens=True),
    "granite-20b-fc": JsonTagsFormat("granite-20b-fc", starts=("<function_call>",)),
    "internlm2": JsonTagsFormat("internlm2", starts=("<|action_start|><|plugin|>",), call_end="<|action_end|>",
                                special_tokens=True),
    "ernie45": JsonTagsFormat("ernie45", starts=("<tool_call>",), call_end="</tool_call>"),
    # GigaChat 3 writes its call as a new message (`<|message_sep|>` + the `function call` role), 3.1 after a token;
    # the call message ends with the end-of-sequence token, which shows with special tokens on
    "gigachat3": JsonTagsFormat("gigachat3", starts=("<|message_sep|>\n\nfunction call<|role_sep|>\n",
                                                     "<|function_call|>"), call_end="</s>", optional_call_end=True,
                                special_tokens=True),
    # Hy3 (Hunyuan V3): GLM's arg_key/arg_value pairs, the name ended by <tool_sep>, calls inside <tool_calls>
    "hy_v3": XmlFormat(
        "hy_v3", starts=("<tool_calls>",), section_end="</tool_calls>",
        func_open="<tool_call>", func_head_end="<tool_sep>", func_close="</tool_call>",
        param_open="<arg_key>", param_head_end="</arg_key>", value_open="<arg_value>", value_close="</arg_value>"),
    "openai": HarmonyFormat("openai"),
    "pythonic": PythonicFormat("pythonic"),
    "gemma4": Gemma4Format("gemma4"),
    # OLMo 3: calls one per line, no list brackets, inside <function_calls> (special tokens in its tokenizer); it
    # writes JSON's null/true/false as often as Python's literals
    "olmo3": PythonicFormat("olmo3", bare_start=None, starts=("<function_calls>",), section_end="</function_calls>",
                            bracketless=True, json_literals=True, special_tokens=True),
    # Llama 4: the pythonic list, sometimes wrapped in its <|python_start|> ... <|python_end|> special tokens
    "llama4_pythonic": PythonicFormat("llama4_pythonic", starts=("<|python_start|>",), section_end="<|python_end|>",
                                      special_tokens=True),
}


def tool_start_markers(fmt) -> tuple[str, ...]:
    return tuple(getattr(fmt, "starts", ()))


def needs_special_tokens(reasoning: str | None, tools: str | None) -> bool:
    """True when a marker of either format is a special token, so the engine must run with
    skip_special_tokens=False or the parser never sees it."""
    r = REASONING_PARSERS.get(reasoning) if reasoning else None
    t = TOOL_PARSERS.get(tools) if tools else None
    return bool((r and r.special_tokens) or (t and getattr(t, "special_tokens", False)))
