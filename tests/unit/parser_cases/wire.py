"""How each format writes reasoning and calls on the wire, written from the model templates (not from our parser),
so the fixture tables can state the same abstract cases for every format.

A case is a list of segments: ("text", s), ("reasoning", s), ("calls", [(name, args), ...]) — one section holding
parallel calls. `expected()` is the folded result the parser must produce.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

Call = tuple[str, dict]


def _val(v) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def hermes(calls: list[Call]) -> str:
    return "".join(
        f'<tool_call>\n{json.dumps({"name": n, "arguments": a}, ensure_ascii=False)}\n</tool_call>' for n, a in calls)


def qwen3_coder(calls: list[Call]) -> str:
    out = []
    for n, a in calls:
        params = "".join(f"<parameter={k}>\n{_val(v)}\n</parameter>\n" for k, v in a.items())
        out.append(f"<tool_call>\n<function={n}>\n{params}</function>\n</tool_call>")
    return "".join(out)


def seed_oss(calls: list[Call]) -> str:
    return qwen3_coder(calls).replace("<tool_call>", "<seed:tool_call>").replace("</tool_call>", "</seed:tool_call>")


def longcat(calls: list[Call]) -> str:
    return hermes(calls).replace("<tool_call>", "<longcat_tool_call>").replace("</tool_call>", "</longcat_tool_call>")


def llama3_json(calls: list[Call]) -> str:
    return "<|python_tag|>" + "; ".join(
        json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


def mistral(calls: list[Call]) -> str:
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, ensure_ascii=False)}" for n, a in calls)


def deepseek_v3(calls: list[Call]) -> str:
    body = "".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a, ensure_ascii=False)}\n```"
        "<｜tool▁call▁end｜>" for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def deepseek_v31(calls: list[Call]) -> str:
    body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a, ensure_ascii=False)}<｜tool▁call▁end｜>"
                   for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def _dsml(outer: str, sep: str = "") -> Callable[[list[Call]], str]:
    d = "｜DSML｜" + sep

    def render(calls: list[Call]) -> str:
        inv = []
        for n, a in calls:
            ps = "".join(
                f'<{d}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">{_val(v)}'
                f"</{d}parameter>\n" for k, v in a.items())
            inv.append(f'<{d}invoke name="{n}">\n{ps}</{d}invoke>\n')
        return f"<{d}{outer}>\n{''.join(inv)}</{d}{outer}>"

    return render


def kimi_k2(calls: list[Call]) -> str:
    body = "".join(f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>"
                   f"{json.dumps(a, ensure_ascii=False)}<|tool_call_end|>" for i, (n, a) in enumerate(calls))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def glm47(calls: list[Call]) -> str:
    return "".join(
        f"<tool_call>{n}\n"
        + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_val(v)}</arg_value>\n" for k, v in a.items())
        + "</tool_call>" for n, a in calls)


def minimax_m2(calls: list[Call]) -> str:
    inv = "".join(
        f'<invoke name="{n}">\n' + "".join(f'<parameter name="{k}">{_val(v)}</parameter>\n' for k, v in a.items())
        + "</invoke>\n" for n, a in calls)
    return f"<minimax:tool_call>\n{inv}</minimax:tool_call>"


def _wrapper(n: str, a: dict, key: str = "arguments") -> str:
    return json.dumps({"name": n, key: a}, ensure_ascii=False)


def minimax_m1(calls: list[Call]) -> str:  # one wrapper per line
    return "<tool_calls>\n" + "".join(_wrapper(n, a) + "\n" for n, a in calls) + "</tool_calls>"


def json_list(open_: str, close: str = "") -> Callable[[list[Call]], str]:
    def render(calls: list[Call]) -> str:
        return open_ + "[" + ", ".join(_wrapper(n, a) for n, a in calls) + "]" + close
    return render


def tagged_wrappers(open_: str, close: str = "", sep: str = "", key: str = "arguments") -> Callable[[list[Call]], str]:
    def render(calls: list[Call]) -> str:
        return sep.join(open_ + _wrapper(n, a, key) + close for n, a in calls)
    return render


def hy_v3(calls: list[Call]) -> str:
    body = "".join(f"<tool_call>{n}<tool_sep>\n" + "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{_val(v)}</arg_value>\n" for k, v in a.items()) + "</tool_call>\n"
        for n, a in calls)
    return f"<tool_calls>\n{body}</tool_calls>"


def harmony_calls(calls: list[Call]) -> str:
    return "".join(f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>"
                   f"{json.dumps(a, ensure_ascii=False)}<|call|>" for n, a in calls)


def pythonic(calls: list[Call]) -> str:
    def lit(v):
        return repr(v)
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={lit(v)}" for k, v in a.items()) + ")" for n, a in calls) + "]"


def _gemma(v) -> str:
    """Gemma 4's template notation: strings between <|"|>, bare keys, true/false/null, numbers as they are."""
    if isinstance(v, str):
        return f'<|"|>{v}<|"|>'
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_gemma(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ",".join(_gemma(x) for x in v) + "]"
    return json.dumps(v)


def gemma4(calls: list[Call]) -> str:
    return "".join(f"<|tool_call>call:{n}{_gemma(a)}<tool_call|>" for n, a in calls)


def llama4_pythonic(calls: list[Call]) -> str:
    return "<|python_start|>" + pythonic(calls) + "<|python_end|>"


def olmo3(calls: list[Call]) -> str:
    # one call per line, values as JSON (its null/true/false are read like Python's literals)
    lines = (f"{n}(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in a.items()) + ")"
             for n, a in calls)
    return "<function_calls>" + "\n".join(lines) + "</function_calls>"


def _xtml_type(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    return {str: "string", int: "number", float: "number", dict: "object", list: "array"}.get(type(v), "null")


def kimi_k3(calls: list[Call]) -> str:
    # Kimi K3's template: attribute values escaped (& then "), a string's value raw, any other JSON
    def attr(s: str) -> str:
        return s.replace("&", "&amp;").replace('"', "&quot;")
    body = "".join(f'<|open|>call tool="{attr(n)}" index="{i}"<|sep|>' + "".join(
        f'<|open|>argument key="{attr(k)}" type="{_xtml_type(v)}"<|sep|>{_val(v)}<|close|>argument<|sep|>'
        for k, v in a.items()) + "<|close|>call<|sep|>" for i, (n, a) in enumerate(calls, 1))
    return f"<|open|>tools<|sep|>{body}<|close|>tools<|sep|>"


MM3 = "]<]minimax[>["  # MiniMax-M3's namespace marker


def _mm3_xml(v) -> str:
    # MiniMax-M3's template (to_xml): a dict's None values left out, list items as <item>, booleans as JSON,
    # anything else with Python's str()
    if isinstance(v, dict):
        return "".join(f"{MM3}<{k}>{_mm3_xml(x)}{MM3}</{k}>" for k, x in v.items() if x is not None)
    if isinstance(v, list):
        return "".join(f"{MM3}<item>{_mm3_xml(x)}{MM3}</item>" for x in v)
    if v is None:
        return ""
    return json.dumps(v) if isinstance(v, bool) else str(v)


def minimax_m3(calls: list[Call]) -> str:
    body = "".join(f'{MM3}<invoke name="{n}">{_mm3_xml(a)}{MM3}</invoke>\n' for n, a in calls)
    return f"{MM3}<tool_call>\n{body}{MM3}</tool_call>"


def phi4_mini_json(calls: list[Call]) -> str:
    return "functools[" + ", ".join(json.dumps({"name": n, "arguments": a}, ensure_ascii=False) for n, a in calls) + "]"


@dataclass
class Fmt:
    tools: str
    reasoning: str | None
    render: Callable[[list[Call]], str]
    think: tuple[str, str] = ("<think>", "</think>")
    typed_by_schema: bool = False  # values typed from the tool schema: the fixture passes one
    text_before_calls: bool = True  # pythonic: a call list only opens the text
    text_after_calls: bool = True  # llama3_json / pythonic: the calls run to the end of the output
    harmony: bool = False
    markers: tuple[str, ...] = field(default=())
    # the "nested" case round-trips (MiniMax-M3's elements need the schema to say what is an array, and its
    # template writes a None list item as nothing: its own cases are MINIMAX_M3_CASES)
    nested: bool = True


FORMATS = [
    Fmt("hermes", "qwen3", hermes, markers=("<tool_call>", "</tool_call>")),
    Fmt("qwen3_json", "qwen3", hermes, markers=("<tool_call>", "</tool_call>")),
    Fmt("qwen3_coder", "qwen3", qwen3_coder, typed_by_schema=True,
        markers=("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")),
    Fmt("qwen3_xml", "nemotron_deci", qwen3_coder, typed_by_schema=True,
        markers=("<tool_call>", "</tool_call>", "<function=", "</parameter>")),
    Fmt("nemotron_nano", "nemotron_v3", qwen3_coder, typed_by_schema=True,
        markers=("<tool_call>", "</tool_call>", "<function=", "</parameter>")),
    Fmt("step3p5", "step3p5", qwen3_coder, typed_by_schema=True,
        markers=("<tool_call>", "</tool_call>", "<function=", "</parameter>")),
    Fmt("seed_oss", "seed_oss", seed_oss, think=("<seed:think>", "</seed:think>"), typed_by_schema=True,
        markers=("<seed:tool_call>", "</seed:tool_call>", "<function=", "</parameter>")),
    Fmt("longcat", None, longcat, markers=("<longcat_tool_call>", "</longcat_tool_call>")),
    Fmt("llama3_json", None, llama3_json, text_after_calls=False, markers=("<|python_tag|>",)),
    Fmt("mistral", "mistral", mistral, think=("[THINK]", "[/THINK]"), text_after_calls=False,
        markers=("[TOOL_CALLS]", "[ARGS]")),
    Fmt("deepseek_v3", "deepseek_r1", deepseek_v3, markers=("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>", "```")),
    Fmt("deepseek_v31", "deepseek_v3", deepseek_v31, markers=("<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>")),
    Fmt("deepseek_v32", None, _dsml("function_calls"), markers=("｜DSML｜",)),
    Fmt("deepseek_v4", "deepseek_v4", _dsml("tool_calls"), markers=("｜DSML｜",)),
    Fmt("deepseek_v41", "deepseek_v41", _dsml("calls", sep=" "), markers=("｜DSML｜",)),
    Fmt("kimi_k2", "kimi_k2", kimi_k2, markers=("<|tool_call", "<|tool_calls_section")),
    Fmt("kimi_k3", "kimi_k3", kimi_k3, think=("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
        markers=("<|open|>", "<|close|>", "<|sep|>", "argument")),
    Fmt("glm45", "glm45", glm47, typed_by_schema=True, markers=("<tool_call>", "<arg_key>", "<arg_value>")),
    Fmt("glm47", "glm45", glm47, typed_by_schema=True, markers=("<tool_call>", "<arg_key>", "</arg_value>")),
    Fmt("minimax_m2", "minimax_m2", minimax_m2, typed_by_schema=True,
        markers=("<minimax:tool_call>", "<invoke", "<parameter")),
    Fmt("minimax_m3", "minimax_m3", minimax_m3, think=("<mm:think>", "</mm:think>"), typed_by_schema=True,
        nested=False, markers=(MM3, "<invoke", "<tool_call>")),
    Fmt("minimax", "deepseek_r1", minimax_m1, markers=("<tool_calls>", "</tool_calls>")),
    Fmt("hunyuan_a13b", "deepseek_r1", json_list("<tool_calls>", "</tool_calls>"),
        markers=("<tool_calls>", "</tool_calls>")),
    Fmt("jamba", None, json_list("<tool_calls>", "</tool_calls>"), markers=("<tool_calls>", "</tool_calls>")),
    Fmt("xlam", "deepseek_r1", json_list("<tool_call>", "</tool_call>"), markers=("<tool_call>", "</tool_call>")),
    Fmt("granite", None, json_list("<|tool_call|>"), markers=("<|tool_call|>",)),
    Fmt("granite4", None, tagged_wrappers("<tool_call>", "</tool_call>"), markers=("<tool_call>", "</tool_call>")),
    Fmt("granite-20b-fc", None, tagged_wrappers("<function_call> ", sep="\n"), markers=("<function_call>",)),
    Fmt("internlm2", None, tagged_wrappers("<|action_start|><|plugin|>", "<|action_end|>", key="parameters"),
        markers=("<|action_start|>", "<|plugin|>", "<|action_end|>")),
    Fmt("ernie45", None, tagged_wrappers("<tool_call>\n", "\n</tool_call>", sep="\n"),
        markers=("<tool_call>", "</tool_call>")),
    Fmt("gigachat3", None, tagged_wrappers("<|message_sep|>\n\nfunction call<|role_sep|>\n", "</s>"),
        markers=("<|message_sep|>", "<|role_sep|>", "</s>")),
    Fmt("hy_v3", "deepseek_r1", hy_v3, typed_by_schema=True, markers=("<tool_call", "<arg_key>", "<arg_value>")),
    Fmt("openai", "gpt_oss", harmony_calls, harmony=True, markers=("<|channel|>", "<|message|>", "<|call|>")),
    Fmt("pythonic", None, pythonic, text_before_calls=False, text_after_calls=False, markers=()),
    Fmt("gemma4", "gemma4", gemma4, think=("<|channel>thought\n", "<channel|>"),
        markers=("<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>")),
    Fmt("llama4_pythonic", None, llama4_pythonic, markers=("<|python_start|>", "<|python_end|>")),
    Fmt("olmo3", "olmo3", olmo3, markers=("<function_calls>", "</function_calls>")),
    Fmt("phi4_mini_json", None, phi4_mini_json, markers=("functools",)),
]


def render_case(fmt: Fmt, segs: list) -> str:
    out = []
    for seg in segs:
        kind = seg[0]
        if kind == "calls":
            out.append(fmt.render(seg[1]))
        elif fmt.harmony:
            ch = "analysis" if kind == "reasoning" else "final"
            end = "<|end|>" if kind == "reasoning" else "<|return|>"
            lead = "<|start|>assistant" if out else ""
            out.append(f"{lead}<|channel|>{ch}<|message|>{seg[1]}{end}")
        elif kind == "reasoning":
            out.append(f"{fmt.think[0]}{seg[1]}{fmt.think[1]}")
        else:
            out.append(seg[1])
    return "".join(out)


def expected(segs: list) -> list:
    """Folded result: ("text"|"reasoning", s) and ("call", name, args), adjacent text merged."""
    out: list = []
    for seg in segs:
        if seg[0] == "calls":
            out.extend(("call", n, a) for n, a in seg[1])
        elif out and out[-1][0] == seg[0]:
            out[-1] = (seg[0], out[-1][1] + seg[1])
        elif seg[1]:
            out.append((seg[0], seg[1]))
    return out


def schemas_for(segs: list) -> list[dict]:
    """OpenAI function schemas typing each argument by its Python type (for the XML formats)."""
    names: dict[str, dict] = {}
    tmap = {str: "string", bool: "boolean", int: "integer", float: "number", dict: "object", list: "array"}
    for seg in segs:
        if seg[0] == "calls":
            for n, a in seg[1]:
                props = names.setdefault(n, {})
                for k, v in a.items():
                    props[k] = {"type": tmap[type(v)]} if v is not None else {"type": ["integer", "null"]}
    return [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": p}}}
            for n, p in names.items()]


# MiniMax-M3, hand-written: id -> (wire, tool schemas, expected fold). Nested elements are typed by the schema
# (an element of elements is an object, or an array where the schema says so), arguments are emitted at </invoke>,
# and a call that is malformed or cut off gives its text back.
_ORDER = {"type": "function", "function": {"name": "create_order", "parameters": {"type": "object", "properties": {
    "user_id": {"type": "integer"}, "urgent": {"type": "boolean"}, "ratio": {"type": "number"},
    "note": {"type": "string"}, "maybe": {"type": ["string", "null"]},
    "shipping": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}}},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}}}},
    "tags": {"type": "array", "items": {"type": "string"}}, "empty": {"type": "array"},
    "meta": {"type": "object", "additionalProperties": {"type": "integer"}}}}}}
_PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}


def _el(k: str, inner: str) -> str:
    return f"{MM3}<{k}>{inner}{MM3}</{k}>"


def _inv(name: str, body: str) -> str:
    return f'{MM3}<invoke name="{name}">{body}{MM3}</invoke>'


def _sec(*invokes: str) -> str:
    return f"{MM3}<tool_call>\n" + "\n".join(invokes) + f"\n{MM3}</tool_call>"


_NESTED = (_el("user_id", "0042") + _el("urgent", "true") + _el("ratio", "2.5") + _el("note", " a < b & c ")
           + _el("maybe", "null")
           + _el("shipping", _el("city", "Singapore") + _el("zip", "018956"))
           + _el("items", _el("item", _el("sku", "book-1") + _el("qty", "2")) + _el("item", _el("sku", "pen") + _el("qty", "5")))
           + _el("tags", _el("item", "x") + _el("item", "y")) + _el("empty", "")
           + _el("meta", _el("a", "1") + _el("b", "2")))
_CUT = _inv("create_order", _el("note", "cut off here"))[:-len(MM3 + "</invoke>") - 4]

MINIMAX_M3_CASES = {
    "nested_object_array_and_scalars": (
        _sec(_inv("create_order", _NESTED)), [_ORDER],
        [("call", "create_order", {"user_id": 42, "urgent": True, "ratio": 2.5, "note": " a < b & c ", "maybe": None,
                                   "shipping": {"city": "Singapore", "zip": 18956},
                                   "items": [{"sku": "book-1", "qty": 2}, {"sku": "pen", "qty": 5}],
                                   "tags": ["x", "y"], "empty": [], "meta": {"a": 1, "b": 2}})]),
    # without a schema an element of elements is an object and a repeated name a list; text stays a string
    # (elements all named `item` are the template's list: read back as one, so the turn re-renders as written)
    "undescribed_values": (
        _sec(_inv("other", _el("n", "7") + _el("o", _el("t", "a") + _el("t", "b") + _el("u", "1"))
                  + _el("l", _el("item", "x") + _el("item", _el("k", "v"))))), [],
        [("call", "other", {"n": "7", "o": {"t": ["a", "b"], "u": "1"}, "l": ["x", {"k": "v"}]})]),
    # a bare </mm:think> opening the output is the template's markup; one after the output began is text
    "late_end_marker_is_text": ("</mm:think>Hi </mm:think>there", [], [("text", "Hi </mm:think>there")]),
    "several_calls_text_before": (
        "Ordering both.\n" + _sec(_inv("create_order", _el("user_id", "1")), _inv("ping", ""),
                                   _inv("create_order", _el("user_id", "2"))), [_ORDER, _PING],
        [("text", "Ordering both.\n"), ("call", "create_order", {"user_id": 1}), ("call", "ping", {}),
         ("call", "create_order", {"user_id": 2})]),
    "reasoning_then_call": (
        "<mm:think>Need the order.</mm:think>Sure." + _sec(_inv("ping", "")), [_PING],
        [("reasoning", "Need the order."), ("text", "Sure."), ("call", "ping", {})]),
    # a stray close tag: the invoke is malformed; its text comes back, the call after it stands
    "malformed_invoke": (
        _sec(_inv("create_order", f"{MM3}</user_id>"), _inv("ping", "")), [_ORDER, _PING],
        [("text", f"{MM3}<tool_call>\n" + _inv("create_order", f"{MM3}</user_id>")), ("call", "ping", {})]),
    "unclosed_element_is_malformed": (
        "A" + _sec(_inv("create_order", f"{MM3}<note>open")), [_ORDER],
        [("text", "A" + _sec(_inv("create_order", f"{MM3}<note>open")))]),
    "text_between_elements_is_malformed": (
        _sec(_inv("ping", "junk" + _el("a", "1"))), [_PING],
        [("text", _sec(_inv("ping", "junk" + _el("a", "1"))))]),
    "cut_off_by_eof": (
        "Before. " + f"{MM3}<tool_call>\n" + _CUT, [_ORDER],
        [("text", "Before. " + f"{MM3}<tool_call>\n" + _CUT)]),
    "cut_off_after_a_call": (
        f"{MM3}<tool_call>\n" + _inv("ping", "") + "\n" + _CUT, [_ORDER, _PING],
        [("call", "ping", {}), ("text", "\n" + _CUT)]),
    "head_without_a_name_is_text": (
        f'{MM3}<tool_call>{MM3}<invoke name="">{MM3}</invoke>{MM3}</tool_call>', [],
        [("text", f'{MM3}<tool_call>{MM3}<invoke name="">{MM3}</invoke>{MM3}</tool_call>')]),
    "no_section_is_text": (_inv("ping", ""), [_PING], [("text", _inv("ping", ""))]),
}
