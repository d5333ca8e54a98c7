"""Prefix stability at template level: for each template × parser pair and each API's history shape, render
turn N, take the model's output (a forced script, tokenized the way the forcing logits processor feeds it to the
engine, plus the end-of-turn token), send it through the API's real encoder, append it to the history exactly as
that client sends it back, convert with the API's real adapter and render turn N+1. N+1 must start with N's
prompt ids + the generated ids, or — for a template that drops earlier thinking by design — with exactly that
minus the dropped think blocks.

The reused-prefix fraction per pair is printed at the end of the module (`pytest -s`). The engine-backed variant
feeds `check_turn` with ids from a real generation instead of the script's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from serve_app.parsers import parse_complete
from serve_app.prompt import PromptRenderer, load_tokenizer
from tests.support.family_sessions import HEADER, SYSTEM, TOOLS  # the one scripted agent's prompt and tools
from tests.support.stability import agent_request, api_conversation, api_next_turn, check_turn
from serve_app.settings import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
SECRET = b"prefix-stability-secret"

# What the model says over a three-turn chain: think + two parallel calls; think + answer.
TURN1 = ("I should look at the files first.", "", [("ls", {"path": "."}), ("read_file", {"path": "README.md",
                                                                                          "limit": 20})])
TURN2 = ("The listing shows two files, and the README names the entry point.",
         "There are two files: a.py and b.py. The entry point is a.py.", [])


# -- canonical output per template family: what a model trained on that template generates ------------------------

def _hermes(calls, sep_first: bool) -> str:
    out = []
    for i, (name, args) in enumerate(calls):
        sep = "\n" if (i == 0 and sep_first) or i > 0 else ""
        out.append(sep + '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(args) + "}\n</tool_call>")
    return "".join(out)


def qwen3_script(reasoning: str | None, text: str, calls) -> str:  # the prompt opened "<think>\n" (or closed it)
    return ("" if reasoning is None else f"{reasoning}\n</think>\n\n") + text + _hermes(calls, bool(text))


def xml_script(reasoning: str | None, text: str, calls) -> str:
    out = ("" if reasoning is None else f"{reasoning}\n</think>\n\n") + text
    for i, (name, args) in enumerate(calls):
        out += ("\n" if (i == 0 and text) or i > 0 else "") + f"<tool_call>\n<function={name}>\n"
        for k, v in args.items():
            out += f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        out += "</function>\n</tool_call>"
    return out


def content_only_script(reasoning: str | None, text: str, calls) -> str:  # the model opens <think> itself
    if reasoning is None:
        return text + "".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>"
                              for n, a in calls)
    return (f"<think>\n{reasoning}\n</think>" + (f"\n\n{text}" if text else "")
            + "".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>" for n, a in calls))


def r1_script(reasoning: str, text: str, calls) -> str:  # the prompt opened "<think>\n"
    return (f"{reasoning}\n</think>" + (f"\n\n{text}" if text else "")
            + "".join('<tool_call>\n{"name": "' + n + '", "arguments": ' + json.dumps(a) + "}\n</tool_call>"
                      for n, a in calls))


def smollm2_script(reasoning: str | None, text: str, calls) -> str:  # serve_app/templates/smollm2_tools.jinja
    return (("" if reasoning is None else f"<think>\n{reasoning}\n</think>" + ("\n\n" if text else "")) + text
            + "".join('<tool_call>\n{"name": "' + n + '", "arguments": ' + json.dumps(a) + "}\n</tool_call>"
                      for n, a in calls))


@dataclass(frozen=True)
class Pair:
    name: str
    template: Path
    reasoning: str
    tools: str
    script: Callable
    drops_thinking: bool = False  # the template cuts earlier think blocks by design


PAIRS = [
    Pair("qwen3_like/qwen3+hermes", ROOT / "tests/templates/qwen3_like.jinja", "qwen3", "hermes", qwen3_script),
    Pair("xml_tools/qwen3+qwen3_coder", ROOT / "tests/templates/xml_tools.jinja", "qwen3", "qwen3_coder",
         xml_script),
    Pair("content_only/qwen3+hermes", ROOT / "tests/templates/content_only.jinja", "qwen3", "hermes",
         content_only_script),
    Pair("r1_like/deepseek_r1+hermes", ROOT / "tests/templates/r1_like.jinja", "deepseek_r1", "hermes", r1_script,
         drops_thinking=True),
    Pair("smollm2_tools/qwen3+hermes", ROOT / "serve_app/templates/smollm2_tools.jinja", "qwen3", "hermes",
         smollm2_script),
]
APIS = ["anthropic", "responses", "chat"]
REPORT: list[tuple[str, str, str, int, int, float, bool]] = []


@pytest.fixture(scope="module")
def tokenizer_path():
    from serve_app.engine.provision import default_tokenizer_source

    return default_tokenizer_source()


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if REPORT:
        print("\nreused-prefix fraction per pair (turn N cache → turn N+1 prompt)")
        print(f"{'template/parsers':48} {'api':10} {'turn':5} {'reused':>7} {'cached':>7} {'frac':>6}  stable")
        for name, api, turn, reused, cached, frac, ok in REPORT:
            print(f"{name:48} {api:10} {turn:5} {reused:7d} {cached:7d} {frac:6.3f}  {ok}")


_RENDERERS: dict[str, PromptRenderer] = {}


def make_renderer(path: str, pair: Pair) -> PromptRenderer:
    if pair.name not in _RENDERERS:  # one tokenizer load per pair, shared by the three APIs
        tok = load_tokenizer(path, str(pair.template))
        _RENDERERS[pair.name] = PromptRenderer(
            tok, ModelConfig(id="m", reasoning_parser=pair.reasoning, tool_parser=pair.tools))
    return _RENDERERS[pair.name]


def first_request(api: str, thinking: bool) -> dict:
    return agent_request(api, thinking, SYSTEM, "List the files and tell me the entry point.", TOOLS, HEADER)


def to_conversation(api: str, body: dict):
    return api_conversation(api, body, SECRET)


def next_turn(api: str, body: dict, events, next_user: str):
    return api_next_turn(api, body, events, SECRET, next_user)


THINK_BLOCK = re.compile(r"<think>\n.*?</think>", re.S)


# An R1-style model always thinks (its template opens <think> whatever the request says): no "no-thinking" case.
CASES = [pytest.param(pair, thinking, id=f"{pair.name}-{'thinking' if thinking else 'no-thinking'}")
         for pair in PAIRS for thinking in (True, False) if thinking or not pair.drops_thinking]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("pair,thinking", CASES)
def test_turn_n_plus_1_starts_with_turn_n_and_its_output(tokenizer_path, pair, api, thinking):
    r = make_renderer(tokenizer_path, pair)
    tok = r.tokenizer
    schemas = [{"type": "function", "function": {"name": n, "description": d, "parameters": s}} for n, d, s in TOOLS]
    body = first_request(api, thinking)
    conv, opts = to_conversation(api, body)
    assert (r.template_kwargs(opts)["enable_thinking"]) is thinking
    for turn, (reasoning, text, calls), next_user in [(1, TURN1, ""), (2, TURN2, "Now count the lines of a.py.")]:
        reasoning = reasoning if thinking else None
        rendered = r.render_sync(conv, opts)
        assert "billing" not in rendered.text
        script = pair.script(reasoning, text, calls)
        generated = tok.encode(script, add_special_tokens=False) + [tok.eos_token_id]
        events = parse_complete(script, reasoning=pair.reasoning, tools=pair.tools, tool_schemas=schemas,
                                starts_in_reasoning=rendered.starts_in_reasoning)
        assert [e.name for e in events if hasattr(e, "name")] == [n for n, _ in calls]  # the parser saw the calls
        body, conv, opts = next_turn(api, body, events, next_user)
        nxt = r.render_sync(conv, opts)
        expected = None
        if pair.drops_thinking and not calls:  # (thinking is on: see the skip above)
            # The answer turn is followed by a new user query: the template drops every earlier think block.
            cached_text = rendered.text + script + tok.eos_token
            prefix = rendered.text[: -len(r.policy.opener)] if rendered.text.endswith(r.policy.opener) else rendered.text
            expected_text = THINK_BLOCK.sub("", prefix + script.split("</think>", 1)[1] + tok.eos_token)
            assert expected_text != cached_text
            expected = tok.encode(expected_text, add_special_tokens=False)
        result = check_turn(rendered.token_ids, generated, nxt.token_ids, expected)
        REPORT.append((pair.name + ("" if thinking else " (no thinking)"), api, f"{turn}→{turn + 1}", result.reused,
                       len(result.cached),
                       result.reused_fraction, result.stable))
        assert result.stable, f"{pair.name} {api} turn {turn}: " + result.diverges_at(tok)
        if expected is None:
            assert result.reused_fraction == 1.0
