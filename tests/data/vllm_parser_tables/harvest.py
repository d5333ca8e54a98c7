"""Regenerate tables.json from a vLLM source checkout: the declarative test vectors of vLLM's parser tests for the
formats this service ships (see NOTICE.md for what is taken and from which revision).

    python tests/data/vllm_parser_tables/harvest.py /path/to/vllm-checkout [--commit SHA]

    python tests/data/vllm_parser_tables/harvest.py /path/to/vllm-checkout --debug   # + how each streaming test went

    python tests/data/vllm_parser_tables/harvest.py /path/to/tree --commit BASE --file-sources sources.json

`--file-sources` names, per file read, where it came from when the tree is assembled from several revisions
(`{"tests/...py": {"commit": SHA, "date": "YYYY-MM-DD" or null, "via": "..."}}`); tables.json keeps it as `files`.

Each test module is executed with its vLLM/transformers imports stubbed (no vLLM, tokenizer or network needed;
openai_harmony is the real one, to render the gpt-oss conversations). Three sources: module-level reasoning dicts
(`{"output", "reasoning", "content"}`), `ToolParserTestConfig` fixtures, and every test function that parses a
whole text, run against a probe parser that records the text and the assertions made on the result (a test that
streams the text through vLLM's test helpers is recorded as its whole text; a stubbed tokenizer encodes one token
per character, so tests that cut a text into token chunks still yield it). A test that calls the parser's streaming
method itself yields a vector with the delta sequences it fed (`delta_sequences`) and its assertions on the folded
result (see `Recording.stream_call`).
"""

from __future__ import annotations

import argparse
import builtins
import importlib.abc
import importlib.machinery
import json
import random
import subprocess
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEBUG = "--debug" in sys.argv

# vLLM reasoning test file -> (our reasoning parser, prompt opens the think block). The second field is the prompt
# state vLLM's parser assumes: its qwen3/deepseek_r1/minimax_m2/nemotron_v3/kimi parsers treat output without a start
# marker as reasoning because those templates open <think> in the prompt (None: the format's default). A test that
# builds its parser with enable_thinking/thinking False gets False instead.
REASONING_FILES = {
    "tests/reasoning/test_qwen3_reasoning_parser.py": ("qwen3", True),
    "tests/reasoning/test_deepseekr1_reasoning_parser.py": ("deepseek_r1", True),
    "tests/reasoning/test_glm4_moe_reasoning_parser.py": ("glm45", None),
    "tests/reasoning/test_minimax_m2_reasoning_parser.py": ("minimax_m2", True),
    "tests/reasoning/test_mistral_reasoning_parser.py": ("mistral", None),
    "tests/reasoning/test_nemotron_v3_reasoning_parser.py": ("nemotron_v3", True),
    # GLM-4.7's and Kimi-K2.5's templates open <think> in the generation prompt (vLLM parses both as R1)
    "tests/reasoning/test_glm47_reasoning_parser.py": ("glm47", True),
    "tests/reasoning/test_kimi_k25_reasoning_parser.py": ("kimi_k25", True),
    # Step-3.5's, Seed-OSS's and OLMo 3's parsers read text before the end marker as reasoning (base thinking parser)
    "tests/reasoning/test_step3p5_reasoning_parser.py": ("step3p5", True),
    "tests/reasoning/test_seedoss_reasoning_parser.py": ("seed_oss", True),
    "tests/reasoning/test_olmo3_reasoning_parser.py": ("olmo3", True),
    # ERNIE-4.5's parser is the base thinking parser (text before the end marker is reasoning); Hunyuan-A13B's and
    # Granite's read reasoning only after their start marker; MiniMax-M2's template opens <think>, which the
    # append-think parser puts back in front of the content
    "tests/reasoning/test_ernie45_reasoning_parser.py": ("ernie45", True),
    "tests/reasoning/test_hunyuan_reasoning_parser.py": ("hunyuan_a13b", False),
    "tests/reasoning/test_granite_reasoning_parser.py": ("granite", False),
    "tests/reasoning/test_minimax_m2_append_reasoning_parser.py": ("minimax_m2_append_think", True),
    # Gemma 4's template does not open its <|channel> block in the prompt (thinking off renders an empty one)
    "tests/reasoning/test_gemma4_reasoning_parser.py": ("gemma4", False),
    # Kimi K3's template opens its think channel in the generation prompt (thinking off: the response channel)
    "tests/reasoning/test_kimi_k3_reasoning_parser.py": ("kimi_k3", True),
    # MiniMax-M3's template opens <mm:think> only with thinking_mode "enabled" (its default, adaptive, opens nothing);
    # the tests that build their parser with thinking_mode "enabled" start in reasoning (read from its kwargs)
    "tests/reasoning/test_minimax_m3_reasoning_parser.py": ("minimax_m3", False),
}
TOOL_FILES = {
    "tests/tool_parsers/test_deepseekv3_tool_parser.py": "deepseek_v3",
    "tests/tool_parsers/test_qwen3xml_tool_parser.py": "qwen3_xml",
    "tests/tool_parsers/test_kimi_k2_tool_parser.py": "kimi_k2",
    "tests/tool_parsers/test_pythonic_tool_parser.py": "pythonic",
    "tests/tool_parsers/test_mistral_tool_parser.py": "mistral",
    "tests/tool_parsers/test_qwen3coder_tool_parser.py": "qwen3_coder",
    "tests/tool_parsers/test_glm4_moe_tool_parser.py": "glm45",
    "tests/tool_parsers/test_glm47_moe_tool_parser.py": "glm47",
    "tests/tool_parsers/test_hermes_tool_parser.py": "hermes",
    "tests/tool_parsers/test_llama3_json_tool_parser.py": "llama3_json",
    "tests/tool_parsers/test_deepseekv31_tool_parser.py": "deepseek_v31",
    "tests/tool_parsers/test_deepseekv32_tool_parser.py": "deepseek_v32",
    "tests/tool_parsers/test_deepseekv4_tool_parser.py": "deepseek_v4",
    "tests/tool_parsers/test_minimax_m2_tool_parser.py": "minimax_m2",
    "tests/tool_parsers/test_step3p5_tool_parser.py": "step3p5",
    "tests/tool_parsers/test_seed_oss_tool_parser.py": "seed_oss",
    "tests/tool_parsers/test_longcat_tool_parser.py": "longcat",
    "tests/tool_parsers/test_gemma4_tool_parser.py": "gemma4",
    "tests/tool_parsers/test_olmo3_tool_parser.py": "olmo3",
    "tests/tool_parsers/test_llama4_pythonic_tool_parser.py": "llama4_pythonic",
    "tests/tool_parsers/test_phi4mini_tool_parser.py": "phi4_mini_json",
    "tests/tool_parsers/test_minimax_tool_parser.py": "minimax",  # MiniMax-M1 (JSON lines), not minimax_m2
    "tests/tool_parsers/test_hunyuan_a13b_tool_parser.py": "hunyuan_a13b",
    "tests/tool_parsers/test_jamba_tool_parser.py": "jamba",
    "tests/tool_parsers/test_xlam_tool_parser.py": "xlam",
    "tests/tool_parsers/test_granite_tool_parser.py": "granite",
    "tests/tool_parsers/test_granite4_tool_parser.py": "granite4",
    "tests/tool_parsers/test_granite_20b_fc_tool_parser.py": "granite-20b-fc",
    "tests/tool_parsers/test_internlm2_tool_parser.py": "internlm2",
    "tests/tool_parsers/test_hy_v3_tool_parser.py": "hy_v3",
    "tests/tool_parsers/test_ernie45_moe_tool_parser.py": "ernie45",
    "tests/tool_parsers/test_gigachat3_tool_parser.py": "gigachat3",
    "tests/tool_parsers/test_kimi_k3_tool_parser.py": "kimi_k3",
    "tests/tool_parsers/test_minimax_m3_tool_parser.py": "minimax_m3",
}

# Inline tests recorded by running them against a probe parser: file -> (reasoning parser, tool parser, prompt
# opens the think block, Harmony). BY_NAME: the tool parser is the one the test looks up in vLLM's registry (only the
# formats this service ships are kept).
BY_NAME = "<by name>"
SHIPPED_TOOL_PARSERS = {*TOOL_FILES.values(), "openai", "qwen3_xml", "qwen3_coder"}
INLINE_FILES = {
    **{rel: (None, parser, None, False) for rel, parser in TOOL_FILES.items()},
    "tests/tool_parsers/test_openai_tool_parser.py": ("gpt_oss", "openai", None, True),
    "tests/entrypoints/openai/parser/test_harmony_utils.py": ("gpt_oss", "openai", None, True),
    # bug reproducers added after the first harvest; the Qwen3 file drives both vLLM's qwen3_xml and qwen3_coder
    # parsers, one format here
    "tests/tool_parsers/test_qwen3_xml_coder_shared.py": (None, "qwen3_coder", None, False),
    "tests/tool_parsers/test_qwen36_bugs.py": (None, "qwen3_coder", None, False),
    "tests/tool_parsers/test_glm47_final_delta_bug.py": (None, "glm47", None, False),
    "tests/reasoning/test_qwen3_tool_call_recovery.py": ("qwen3", None, True, False),
    "tests/reasoning/test_issue_35221.py": ("qwen3", None, True, False),  # Qwen3.5's template opens <think>
    # one fixture per format, each naming vLLM's parser: the vector takes the name its test asked the registry for
    "tests/tool_parsers/test_format_conformance.py": (None, BY_NAME, None, False),
    "tests/reasoning/test_kimi_k2_reasoning_parser.py": ("kimi_k2", None, True, False),
    # deepseek_v3 switches on chat_template_kwargs thinking: its file's whole-text test is the thinking-off
    # (identity) case. The gpt-oss file asserts only is_reasoning_end / structured tags (no parsed text), so it
    # yields nothing; it is listed so a later revision's text vectors are picked up.
    "tests/reasoning/test_deepseekv3_reasoning_parser.py": ("deepseek_v3", None, False, False),
    "tests/reasoning/test_gptoss_reasoning_parser.py": ("gpt_oss", None, None, True),
    # Hy3 and Holo2 switch on chat_template_kwargs per test case (their module-level dicts do not say which case
    # they are, so only the recorded calls count): Hy3 thinks only with a reasoning_effort other than "no_think",
    # Holo2 unless thinking=False
    "tests/reasoning/test_hy_v3_reasoning_parser.py": ("hy_v3", None, False, False),
    "tests/reasoning/test_holo2_reasoning_parser.py": ("holo2", None, True, False),
    **{rel: (parser, None, opens, False) for rel, (parser, opens) in REASONING_FILES.items()},
}


# -- stubs: just enough of pytest / vllm / transformers for a test module to import and define its values ---------

class StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Stub()


class Stub(metaclass=StubMeta):
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return Stub()
    def __getattr__(self, name): return Stub()
    def __iter__(self): return iter(())
    def __getitem__(self, k): return Stub()
    def __or__(self, other): return Stub()
    __ror__ = __or__


class Recorded:
    """ToolCall / FunctionCall / ToolParserTestConfig: keeps its keyword arguments."""

    def __init__(self, *a, **k):
        self.args, self.kwargs = a, k

    def __getattr__(self, name):
        if name in ("args", "kwargs"):
            raise AttributeError(name)
        if name == "type" and "function" in self.kwargs:
            return self.kwargs.get("type", "function")  # a ToolCall's type defaults to "function"
        return self.kwargs.get(name)


_CLASSES: dict[str, type] = {}  # one class per name, so isinstance() in the tests works


def _source_constants(module: str) -> dict[str, str]:
    """The module-level string constants of a vLLM module's own source (a test that imports the parser's markers,
    e.g. `TOOL_CALL_START`, compares text with them: a stub would make every such test fail)."""
    if module not in _CONSTANTS:
        found: dict[str, str] = {}
        root = StubModule.source_root
        parts = module.split(".")
        if root is not None and parts[0] == "vllm":
            for f in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
                if f.is_file():
                    for node in ast.parse(f.read_text()).body:
                        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                                isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Constant) and \
                                isinstance(node.value.value, str):
                            found[node.targets[0].id] = node.value.value
                    break
        _CONSTANTS[module] = found
    return _CONSTANTS[module]


_CONSTANTS: dict[str, dict[str, str]] = {}


class StubModule(types.ModuleType):
    extra: dict = {}
    source_root: Path | None = None  # the vLLM tree being harvested (its modules' string constants are real)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in StubModule.extra:
            return StubModule.extra[name]
        if name in (consts := _source_constants(self.__name__)):
            return consts[name]
        if name.endswith(("ToolParser", "ReasoningParser")) and "_probe_parser" in StubModule.extra:
            return StubModule.extra["_probe_parser"]
        # vLLM's delegating parser (vllm.parser.*: reasoning and tools in one `parse`), as Kimi K3's tests use it
        if self.__name__.startswith("vllm.parser.") and name.endswith("Parser") and \
                "_probe_parser" in StubModule.extra:
            return StubModule.extra["_probe_parser"]
        if name in _CLASSES:
            return _CLASSES[name]
        if name in ("ToolCall", "FunctionCall", "ToolParserTestConfig", "DeltaToolCall", "DeltaFunctionCall",
                    "ChatCompletionRequest", "ChatCompletionToolsParam", "FunctionDefinition", "FunctionTool"):
            return _CLASSES.setdefault(name, type(name, (Recorded,), {}))
        return _CLASSES.setdefault(name, type(name, (Stub,), {}))


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    ROOTS = ("vllm", "transformers", "tests", "mistral_common", "torch", "partial_json_parser")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


class Param:
    def __init__(self, *values, id=None, marks=None):
        self.values, self.id, self.marks = values, id, marks


TABLES: list[dict] = []


def _pytest_module() -> types.ModuleType:
    pt = types.ModuleType("pytest")

    def fixture(*a, **k):
        if a and callable(a[0]) and not k:
            return a[0]

        def deco(f):
            if k.get("params") is not None:  # a parametrized fixture: the harvest uses its first value
                f._vllm_param = list(k["params"])[0]
            return f
        return deco

    class Mark:
        def parametrize(self, names=None, values=None, ids=None, argnames=None, argvalues=None, **k):
            names = names if names is not None else argnames
            values = values if values is not None else argvalues

            def deco(f):
                TABLES.append({"func": f.__qualname__, "names": [n.strip() for n in
                                                                  (names.split(",") if isinstance(names, str)
                                                                   else names)],
                               "values": list(values), "ids": ids})
                return f
            return deco

        def __getattr__(self, name):
            return lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))

    pt.fixture = fixture
    pt.mark = Mark()
    pt.param = Param
    pt.FixtureRequest = Stub
    pt.raises = Stub()
    pt.skip = pt.xfail = pt.importorskip = Stub()
    return pt


def load(path: Path) -> dict:
    TABLES.clear()
    ns: dict = {"__name__": "harvested", "__file__": str(path), "__builtins__": builtins}
    exec(compile(path.read_text(), str(path), "exec"), ns)
    return ns


# -- normalising into vectors ---------------------------------------------------------------------------------------

def _call(tc) -> dict:
    fn = tc.kwargs.get("function", tc) if isinstance(tc, Recorded) else tc
    name = fn.kwargs.get("name")
    args = fn.kwargs.get("arguments")
    try:
        return {"name": name, "arguments": json.loads(args) if isinstance(args, str) and args else {}}
    except ValueError:  # a truncated-call expectation: vLLM streams the arguments text it has
        return {"name": name, "arguments_text": args}


# module-level reasoning dicts whose test does not assert their reasoning/content (read by hand from the test)
UNASSERTED_TEXTS: set[tuple[str, str]] = set()
UNASSERTED = {
    # `if request.node.callspec.id != "multi_turn_prompt_content": assert reasoning == ...`
    ("tests/reasoning/test_step3p5_reasoning_parser.py", "MULTI_TURN_PROMPT_CONTENT"),
}


def _reasoning_vectors(rel: str, ns: dict, parser: str, opens: bool | None) -> list[dict]:
    out = []
    for var, v in ns.items():
        if not (isinstance(v, dict) and isinstance(v.get("output"), str) and "content" in v
                and ("reasoning" in v or "reasoning_content" in v)):
            continue
        if (rel, var) in UNASSERTED:  # its text is not a vector when the test function runs it inline either
            UNASSERTED_TEXTS.add((rel, v["output"]))
            continue
        out.append({"id": f"{parser}/{var}", "source": f"{rel}::{var}", "reasoning_parser": parser,
                    "tool_parser": None, "prompt_opens_think": opens, "model_output": v["output"],
                    "expect": {"reasoning": v.get("reasoning", v.get("reasoning_content")),
                               "content": v["content"]}})
    return out


def _config_vectors(rel: str, ns: dict, parser: str) -> list[dict]:
    out = []
    for cname, cls in list(ns.items()):
        fixture = getattr(cls, "test_config", None) if isinstance(cls, type) else None
        if fixture is None:
            continue
        cfg = fixture(None)
        if not isinstance(cfg, Recorded):
            continue
        k = cfg.kwargs
        src = f"{rel}::{cname}.test_config"
        # a vector is the folded result, which our parser gives alike whole or streamed: it stands where vLLM meets
        # it in either mode (several of vLLM's parsers do not stream at all, or stream with known faults)
        xfail = set(k.get("xfail_nonstreaming") or {}) & set(k.get("xfail_streaming") or {})

        def vec(test, output, expect):
            if test in xfail:
                return
            out.append({"id": f"{parser}/config.{test}", "source": src, "reasoning_parser": None,
                        "tool_parser": parser, "prompt_opens_think": None, "model_output": output,
                        "expect": expect})

        vec("test_no_tool_calls", k["no_tool_calls_output"],
            {"content": k["no_tool_calls_output"], "calls": []})
        single = {"call_names": [k.get("single_tool_call_expected_name", "get_weather")],
                  "args_subset": [k.get("single_tool_call_expected_args", {"city": "Tokyo"})]}
        if k.get("single_tool_call_expected_content") is not None:
            single["content"] = k["single_tool_call_expected_content"]
        vec("test_single_tool_call_simple_args", k["single_tool_call_output"], single)
        par = {"call_names": k.get("parallel_tool_calls_names", ["get_weather", "get_time"])}
        if k.get("parallel_tool_calls_expected_content") is not None:
            par["content"] = k["parallel_tool_calls_expected_content"]
        vec("test_parallel_tool_calls", k["parallel_tool_calls_output"], par)
        vec("test_various_data_types", k["various_data_types_output"], {"call_count": 1})
        vec("test_empty_arguments", k["empty_arguments_output"], {"call_count": 1, "args_subset": [{}]})
        vec("test_surrounding_text", k["surrounding_text_output"], {"call_count": 1})
        vec("test_escaped_strings", k["escaped_strings_output"], {"call_count": 1})
        for j, bad in enumerate(k.get("malformed_input_outputs") or []):
            vec(f"test_malformed_input[{j}]", bad, {"no_raise": True})
    return out


# -- inline tests: run them against a recording parser -----------------------------------------------------------
#
# Most of vLLM's parser tests are functions that call `parser.extract_tool_calls(text, request)` (or the helpers in
# tests/*/utils.py) and assert on the result. We run each such function with a probe parser: the probe records the
# text it was given, and the result it returns records every assertion made on it (`assert` is rewritten so that a
# failed comparison does not stop the function, and `x is None` becomes `x == None` so it can be recorded). The
# recorded (path, op, value) checks are the vector's expectation. Streaming-only tests on token deltas are skipped.

import ast
import inspect
import itertools


class Vec:
    def __init__(self, text: str, tools, thinking_off: bool = False, thinking_on: bool = False,
                 answer_required: bool = False):
        self.text, self.tools, self.checks, self.thinking_off = text, tools, [], thinking_off
        self.thinking_on = thinking_on
        self.answer_required = answer_required  # the request's force_nonempty_content


class P:
    """A recorded value: comparing it records the expectation and answers True."""

    def __init__(self, vec: Vec, path: tuple):
        object.__setattr__(self, "_v", vec)
        object.__setattr__(self, "_p", path)

    def _rec(self, op, val):
        self._v.checks.append([list(self._p), op, _plain(val)])
        return True

    def __eq__(self, o): return self._rec("==", o)
    def __ne__(self, o): return self._rec("!=", o)
    def __hash__(self): return id(self)
    def __getattr__(self, n):
        if n.startswith("__"):
            raise AttributeError(n)
        STATE["p_touched"] = True
        return P(self._v, self._p + (("attr", n),))
    def __getitem__(self, k):
        STATE["p_touched"] = True
        return P(self._v, self._p + (("item", k),))
    # a loop over a list: its length is unknown here, so the elements are "iter" steps, checked only if present
    def __iter__(self): return (P(self._v, self._p + (("iter", i),)) for i in range(16))
    def __call__(self, *a, **k):
        if self._p and self._p[-1] == ("attr", "get") and a:
            return P(self._v, self._p[:-1] + (("item", a[0]),))
        raise Abort("called a recorded value")


class Abort(Exception):
    pass


def _plain(v):
    if isinstance(v, Recorded):
        return {"_type": type(v).__name__, **{k: _plain(x) for k, x in v.kwargs.items()}}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    raise Abort(f"unrecordable value {type(v).__name__}")


def _tool_dict(t):
    if isinstance(t, dict):
        return t
    if isinstance(t, Recorded):
        fn = t.kwargs.get("function", t)
        if isinstance(fn, Recorded):
            fn = fn.kwargs
        if isinstance(fn, dict) and fn.get("name"):
            return {"type": "function", "function": {"name": fn["name"], "parameters": _plain(fn.get("parameters"))}}
    return None


def _field(obj, name):
    """A keyword a recorded object was built with, or an attribute (a Mock request)."""
    kw = getattr(obj, "kwargs", None)
    return kw.get(name) if isinstance(kw, dict) else getattr(obj, name, None)


def _tools_of(obj):
    tools = _field(obj, "tools")
    if isinstance(tools, list):
        out = [_tool_dict(t) for t in tools]
        return [t for t in out if t]
    return None


def _kwargs_of(request):
    kw = _field(request, "chat_template_kwargs")
    return kw if isinstance(kw, dict) else None


class Internal:
    """vLLM's internal parser state, read by a streaming test: opaque. Any assertion that touches it is skipped."""

    def _touch(self):
        STATE["touched"] = True
        return self

    def __getattr__(self, n):
        if n.startswith("__"):
            raise AttributeError(n)
        return self._touch()

    def __getitem__(self, k): return self._touch()
    def __call__(self, *a, **k): return self._touch()
    def __eq__(self, o): return self._touch()
    def __ne__(self, o): return self._touch()
    def __ge__(self, o): return self._touch()
    def __gt__(self, o): return self._touch()
    def __le__(self, o): return self._touch()
    def __lt__(self, o): return self._touch()
    def __add__(self, o): return self._touch()
    __radd__ = __sub__ = __rsub__ = __add__
    def __hash__(self): return 0
    def __iter__(self): return iter(())
    def __bool__(self):
        self._touch()
        return True


INTERNAL_USE: set[str] = set()  # the internal attributes the current test read

SENTINELS: dict[str, tuple] = {}  # sentinel string -> (stream vector, path of the folded value it stands for)
STATE = {"in_assert": False, "failures": 0, "touched": False, "p_touched": False}


class Delta(types.SimpleNamespace):
    """What the probe's streaming method answers (vLLM's DeltaMessage shape)."""

    def __init__(self, content=None, reasoning=None, tool_calls=None, role=None, **k):
        super().__init__(content=content, reasoning=reasoning, reasoning_content=reasoning, tool_calls=tool_calls,
                         role=role)


_CLASSES["DeltaMessage"] = Delta  # so a test's isinstance(delta, DeltaMessage) holds


class DeltaCall(types.SimpleNamespace):
    pass


class DeltaFn(types.SimpleNamespace):
    pass


def _sentinel(v):
    """The (vector, path) a string stands for, None for a plain string; a string that mixes a sentinel with other
    text (two folded values joined) cannot be recorded."""
    if not isinstance(v, str) or ("\u27e6" not in v and "\u27e7" not in v):
        return None
    if v in SENTINELS:
        return SENTINELS[v]
    if v.startswith("call_") and v[5:] in SENTINELS:
        return SENTINELS[v[5:]]
    raise Skip("one delta's part of a folded value, or a folded value mixed with other text")


class Skip(Exception):
    """An assertion that says nothing about the folded result: neither recorded nor counted as failing."""


def _bind(got, want, bindings) -> bool:
    """Unify a value built from sentinels with a literal: collect (vector, path, literal) bindings; False on a
    concrete mismatch."""
    sg, sw = _sentinel(got), _sentinel(want)
    if sg and sw:
        raise Abort("two folded values compared")
    if sg or sw:
        (vec, path), lit = (sg, want) if sg else (sw, got)
        if isinstance(lit, (str, type(None))):
            bindings.append((vec, path, lit))
            return True
        return False
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(_bind(a, b, bindings) for a, b in zip(got, want))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(_bind(got[x], want[x], bindings) for x in got)
    if isinstance(got, Recorded) and isinstance(want, Recorded):  # FunctionCall(name=…) built from folded values
        return type(got) is type(want) and _bind(got.kwargs, want.kwargs, bindings)
    return got == want


def _has_sentinel(v) -> bool:
    if isinstance(v, str):
        return "\u27e6" in v or "\u27e7" in v
    if isinstance(v, (list, tuple)):
        return any(_has_sentinel(x) for x in v)
    if isinstance(v, dict):
        return any(_has_sentinel(x) for x in v.values()) or any(_has_sentinel(x) for x in v)
    if isinstance(v, Recorded):
        return _has_sentinel(v.kwargs)
    return False


def _eq(a, b, negate=False, direct=False):
    if isinstance(a, Internal) or isinstance(b, Internal):
        return (a if isinstance(a, Internal) else b)._touch()
    if isinstance(a, P) or isinstance(b, P):
        if _has_sentinel(a if isinstance(b, P) else b):
            return True  # a streamed value compared with a non-streamed one: neither is a literal
        if not STATE["in_assert"]:
            # a branch on the result (`if content == "": content = None`), not an expectation: not recorded, and
            # taken as unequal so the value stays recorded for the assertion that follows
            return negate
        return (a != b) if negate else (a == b)
    if not STATE["in_assert"] or not (_has_sentinel(a) or _has_sentinel(b)):
        return (a != b) if negate else (a == b)
    if not direct:  # inside any(), not, or: its truth is not a statement about the folded value
        STATE["touched"] = True
        return (a != b) if negate else (a == b)
    bindings: list = []
    if not _bind(a, b, bindings):
        return negate
    for vec, path, lit in bindings:
        vec.checks.append([list(path), "!=" if negate else "==", lit])
    return True


class Recording:
    """One harvested file's probe parser and helpers."""

    def __init__(self, harmony=None):
        self.vectors: list[Vec] = []
        self.streams: list[Vec] = []
        self.plan = None  # streaming runs: {"counts": deltas per stream, "shape": fill, "k": calls}
        self.harmony = harmony
        rec = self

        class ProbeParser:
            def __init__(self, *a, tools=None, chat_template_kwargs=None, **k):
                self.tools = _tools_of(types.SimpleNamespace(tools=tools)) if tools else None
                self.kwargs = chat_template_kwargs or {}

            def _vec(self, text, request):
                kw = {**self.kwargs, **(_kwargs_of(request) or {})}
                # the template was told not to think: the prompt does not open the think block (Hy3: its
                # reasoning_effort "no_think"); told to think, for a format that thinks only when asked: it does
                effort = kw.get("reasoning_effort")
                # MiniMax-M3's template: thinking_mode "enabled" opens <mm:think>, "disabled" closes it
                mode = kw.get("thinking_mode")
                off = (kw.get("enable_thinking") is False or kw.get("thinking") is False or effort == "no_think"
                       or mode == "disabled")
                on = (kw.get("enable_thinking") is True or kw.get("thinking") is True or bool(effort) and not off
                      or mode == "enabled")
                v = Vec(text, _tools_of(request) or self.tools, off, on, kw.get("force_nonempty_content") is True)
                v.parser_name = getattr(type(self), "vllm_name", None)
                rec.vectors.append(v)
                return v

            def extract_tool_calls(self, model_output, request=None, token_ids=None):
                if token_ids is not None and not model_output:
                    model_output = rec.harmony_text(token_ids)
                return P(self._vec(model_output, request), ())

            def extract_reasoning(self, model_output, request=None):
                v = self._vec(model_output, request)
                return P(v, (("attr", "reasoning"),)), P(v, (("attr", "content"),))

            extract_reasoning_content = extract_reasoning  # vLLM's earlier name (Kimi K3's tests call it)

            def parse(self, model_output, request=None):  # the delegating parser: (reasoning, content, calls)
                v = self._vec(model_output, request)
                return P(v, (("attr", "reasoning"),)), P(v, (("attr", "content"),)), P(v, (("attr", "tool_calls"),))

            def extract_tool_calls_streaming(self, previous_text="", current_text="", delta_text="",
                                             previous_token_ids=None, current_token_ids=None, delta_token_ids=None,
                                             request=None):
                return rec.stream_call(self, previous_text, current_text, delta_text, request)

            def __getattr__(self, n):
                # calls that only query or adjust state (not parse text) pass through, so a test that makes one
                # before parsing still yields its vectors; anything else (a patched regex) ends the test, since its
                # assertions would not be about the text alone. In a streaming test, the parser's internal state
                # (prev_tool_call_arr, streamed_args_for_tool, ...) is an opaque value: assertions on it are skipped
                if n in ("adjust_request", "is_reasoning_end", "is_reasoning_end_streaming", "extract_content_ids",
                         "_reset_streaming_state"):
                    return Stub()
                if n == "vocab":  # token ids a test derives from the vocabulary: only vLLM's parser reads them
                    return {}
                if rec.streams:
                    INTERNAL_USE.add(n)
                    return Internal()
                raise Abort(f"parser.{n}")

            def __setattr__(self, n, v):
                if n in ("tools", "kwargs"):
                    object.__setattr__(self, n, v)  # a test resetting vLLM's internal state: not ours

        self.ProbeParser = ProbeParser

    # -- streaming tests -----------------------------------------------------------------------------------------
    #
    # A test that drives `extract_tool_calls_streaming` itself is run several times. The first run only counts the
    # deltas of each stream (every call answers None). Then, for a number of calls K and two fill shapes (the deltas
    # before the last answer None, or an empty message), the last delta of each stream answers one message holding
    # the whole folded result as sentinel strings: content, reasoning, and per call an id, a name and arguments. The
    # test's own code folds the deltas as it always does; an assertion that compares a folded value with a literal
    # binds that sentinel to the literal, which is recorded as a check on the folded result. A run counts only if
    # every concrete assertion of the test holds (with the wrong K, `len(calls) == 1` fails); assertions on one
    # particular delta (which delta carries what, None while incomplete) are about vLLM's delta protocol, not the
    # folded result, and are not recorded.

    def stream_call(self, parser, previous_text, current_text, delta_text, request):
        st = parser.__dict__.get("_stream")
        # the same stream while the texts continue it (some tests pass previous_text="" throughout; granite4's
        # passes no texts at all, only deltas: its parser keeps its own buffer)
        if st is None or (previous_text != st.text and current_text != st.text + delta_text
                          and (previous_text, current_text) != ("", "")):
            st = Vec("", _tools_of(request) or parser.tools)
            st.deltas, st.calls, st.index = [], 0, len(self.streams)
            st.current_mismatch = False
            self.streams.append(st)
            self.vectors.append(st)
            parser.__dict__["_stream"] = st
        if current_text != st.text + delta_text:
            st.current_mismatch = True
        st.deltas.append(delta_text)
        st.text += delta_text
        st.calls += 1
        plan = self.plan
        if plan is None:
            return None
        n, k = plan["counts"][st.index], plan["k"]
        # where the folded result goes: all in the last delta ("whole"); split over the last two, so only a test
        # that folds the deltas sees a whole sentinel, one that looks at a single delta sees half of one and
        # records nothing ("split"); or one call per delta pair, for tests that want a single call per delta
        # ("spread": the last 2K deltas, call i's halves in pair i, the content's halves in the first pair)
        m = {"whole": 1, "split": min(n, 2), "spread": max(2, 2 * k)}[plan["layout"]]
        j = st.calls - 1 - (n - m)  # this delta's place in the window
        if j < 0:
            return None if plan["shape"] == "none" else Delta(content="", tool_calls=[])
        if m == 1:
            return self.folded_message(st, [(i, None) for i in range(k)], None)
        if plan["layout"] == "split":
            return self.folded_message(st, [(i, j) for i in range(k)], j)
        return self.folded_message(st, [(j // 2, j % 2)] if j // 2 < k else [], j if j < 2 else "none")

    def folded_message(self, st, calls_spec, content_half):
        """A message holding sentinels for the folded result: `calls_spec` (call index, half or None for whole),
        `content_half` (None: whole, 0/1: that half, "none": no content)."""
        def s(tag, path, half):
            key = f"\u27e6{st.index}:{tag}\u27e7"
            SENTINELS[key] = (st, path)
            if half is None:
                return key
            return key[:len(key) - 2] if half == 0 else key[len(key) - 2:]
        calls = []
        for i, half in calls_spec:
            base = (("attr", "tool_calls"), ("item", i))
            first = half in (None, 0)  # the id and the name come whole, with a call's first delta
            fn = DeltaFn(name=s(f"N{i}", base + (("attr", "function"), ("attr", "name")), None) if first else None,
                         arguments=s(f"A{i}", base + (("attr", "function"), ("attr", "arguments")), half))
            calls.append(DeltaCall(index=i, type="function", function=fn, id=(
                "call_" + s(f"I{i}", base + (("attr", "id"),), None)) if first else None))
        if content_half == "none":
            return Delta(content=None, tool_calls=calls)
        return Delta(content=s("C", (("attr", "content"),), content_half),
                     reasoning=s("R", (("attr", "reasoning"),), content_half), tool_calls=calls)

    def harmony_text(self, token_ids) -> str:
        """The model's part of a rendered Harmony conversation: from the first assistant message on, without the
        trailing generation prompt."""
        text = self.harmony.decode(token_ids)
        at = text.find("<|start|>assistant")
        if at < 0:
            raise Abort("no assistant message")
        text = text[at + len("<|start|>assistant"):]
        return text.removesuffix("<|start|>assistant")

    # tests/tool_parsers/utils.py and tests/reasoning/utils.py, recorded
    def run_tool_extraction(self, parser, model_output, request=None, streaming=False, **k):
        if not isinstance(model_output, str):
            model_output = "".join(model_output)
        r = parser.extract_tool_calls(model_output, request)
        return r.content, r.tool_calls

    def run_tool_extraction_nonstreaming(self, parser, model_output, request=None):
        return parser.extract_tool_calls(model_output, request)

    def run_tool_extraction_streaming(self, parser, deltas, request=None, **k):
        r = parser.extract_tool_calls(deltas if isinstance(deltas, str) else "".join(deltas), request)
        return types.SimpleNamespace(tool_calls=r.tool_calls, other_content=r.content)

    def run_reasoning_extraction(self, parser, model_output, request=None, streaming=False):
        return parser.extract_reasoning("".join(model_output), request)

    def run_reasoning_extraction_streaming(self, parser, deltas, request=None):
        reasoning, content = parser.extract_reasoning("".join(deltas), request)
        return types.SimpleNamespace(reasoning=reasoning, other_content=content)


class _Asserts(ast.NodeTransformer):
    """`assert E` -> `_vllm_check(lambda: E, True)`, `assert not E` -> `_vllm_check(lambda: E, False)`; `is (not) None` ->
    `== / !=`, and `==`/`!=`/`in` go through `_vllm_eq`/`_vllm_in`, so the probe and the sentinels see them."""

    def visit_Compare(self, node):
        self.generic_visit(node)
        direct = ast.Constant(getattr(node, "_vllm_direct", False))
        if len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            fn = "_vllm_in" if isinstance(node.ops[0], ast.In) else "_vllm_not_in"
            return ast.copy_location(ast.Call(ast.Name(fn, ast.Load()), [node.left, node.comparators[0], direct],
                                              []), node)
        node.ops = [ast.Eq() if isinstance(o, ast.Is) else ast.NotEq() if isinstance(o, ast.IsNot) else o
                    for o in node.ops]
        if len(node.ops) == 1 and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            return ast.copy_location(ast.Call(ast.Name("_vllm_eq", ast.Load()),
                                              [node.left, node.comparators[0],
                                               ast.Constant(isinstance(node.ops[0], ast.NotEq)), direct], []),
                                     node)
        return node

    def visit_Assert(self, node):
        # only a comparison that is the assertion itself (or one of its `and` terms) states a folded value; one
        # inside any(), not, or a generator does not bind a sentinel
        direct = node.test.values if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And) \
            else [node.test]
        for d in direct:
            d._vllm_direct = True
        self.generic_visit(node)
        test, want = node.test, True
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, want = test.operand, False
        call = ast.Call(func=ast.Name("_vllm_check", ast.Load()),
                        args=[ast.Lambda(ast.arguments([], [], None, [], [], None, []), test),
                              ast.Constant(want)], keywords=[])
        return ast.copy_location(ast.Expr(call), node)


def _check(f, want):
    STATE["in_assert"], STATE["touched"], STATE["p_touched"] = True, False, False
    try:
        v = f()
    except Abort:
        raise
    except Exception as e:
        if not STATE["touched"] and not isinstance(e, Skip):
            STATE["failures"] += 1  # only streaming runs look at this: the assertion could not even be evaluated
        return
    finally:
        STATE["in_assert"] = False
    if STATE["touched"] or isinstance(v, Internal):
        return  # about vLLM's internal state, not the parsed result
    if isinstance(v, P):
        v._rec("truthy", want)
    elif _sentinel(v) if isinstance(v, str) else False:
        vec, path = _sentinel(v)
        vec.checks.append([list(path), "truthy", want])
    elif bool(v) != want and not STATE["p_touched"]:  # (a type check on a recorded value is not a failure)
        STATE["failures"] += 1


def _contains(a, b, negate, direct):
    if isinstance(b, P):
        return b._rec("not contains" if negate else "contains", a)
    if isinstance(b, (list, tuple)) and any(isinstance(x, P) for x in b):
        # membership in a list built from recorded values: each `==` it makes would record a false expectation
        STATE["touched"] = True
        return not negate
    if STATE["in_assert"] and not direct and _has_sentinel(b):
        STATE["touched"] = True
    elif STATE["in_assert"] and direct and isinstance(b, str) and _sentinel(b) and isinstance(a, str):
        vec, path = _sentinel(b)
        vec.checks.append([list(path), "not contains" if negate else "contains", a])
        return True
    return (a not in b) if negate else (a in b)


def _in(a, b, direct=False):
    return _contains(a, b, False, direct)


def _not_in(a, b, direct=False):
    return _contains(a, b, True, direct)


def _json_shim():
    m = types.SimpleNamespace(**{k: getattr(json, k) for k in ("dumps", "JSONDecodeError", "decoder")})

    def loads(s, *a, **k):
        if isinstance(s, P):
            return P(s._v, s._p + (("json",),))
        if isinstance(s, Internal):
            return s._touch()
        if isinstance(s, str) and _sentinel(s):
            vec, path = _sentinel(s)
            return P(vec, path + (("json",),))
        return json.loads(s, *a, **k)

    def dumps(v, *a, **k):
        return v._touch() if isinstance(v, Internal) else json.dumps(v, *a, **k)

    m.loads, m.dumps = loads, dumps
    return m


def _range(*a):
    """`for i in range(len(recorded))` (aligning random ids before comparing whole lists): the recorded list's
    length is unknown here, so the loop runs zero times; assertions inside it are not recorded."""
    if any(isinstance(x, P) for x in a):
        return range(0)
    return builtins.range(*a)


def _len(x):
    if isinstance(x, Internal):
        return x._touch()
    if STATE["in_assert"] and isinstance(x, str) and _has_sentinel(x):
        STATE["touched"] = True  # the length of a recorded id or text says nothing about the folded result
    if isinstance(x, P):
        return P(x._v, x._p + (("len",),))
    return builtins.len(x)


def _resolve(name, owner, ns, rec, row, depth=0):
    if name in row:
        return row[name]
    fix = getattr(owner, name, None) if owner is not None else None
    if fix is None:
        fix = ns.get(name)
    if name == "request":  # pytest's FixtureRequest: fixtures looked up by name
        return types.SimpleNamespace(param=None, node=Stub(), getfixturevalue=lambda n: _resolve(
            n, owner, ns, rec, row, depth + 1))
    if name.endswith("parser_cls"):  # a fixture that hands the test a parser class (parametrized over vLLM's)
        return rec.ProbeParser
    if "parser" in name:
        val = _call_fixture(fix, owner, ns, rec, depth) if callable(fix) else None
        return val if isinstance(val, rec.ProbeParser) else rec.ProbeParser()
    if name == "harmony_encoding" and rec.harmony is not None:
        return rec.harmony
    if name in ("streaming",):
        return False
    val = Stub()
    if callable(fix) and depth < 4:
        try:
            val = _call_fixture(fix, owner, ns, rec, depth)
        except Abort:
            raise
        except Exception:
            pass
    # a real (stubbed) tokenizer: tests that cut a text into token-sized deltas get one character per token; a
    # module's own fake tokenizer is kept
    if name.endswith("tokenizer") and type(val) is not CharTokenizer and isinstance(val, Stub):
        return CharTokenizer()
    return val


class CharTokenizer(Stub):
    """encode/decode as one token per character: a test that streams a text in token chunks then feeds the same
    text, only cut differently (the conformance test folds deltas and tries every split anyway)."""

    def encode(self, text, *a, **k):
        return [ord(c) for c in text]

    def decode(self, ids, *a, **k):
        return "".join(chr(i) for i in ids)

    def tokenize(self, text, *a, **k):  # tokens as strings: one character each
        return list(text)

    def convert_tokens_to_string(self, tokens, *a, **k):
        return "".join(tokens)

    def convert_tokens_to_ids(self, tokens, *a, **k):
        return [ord(c) for c in tokens] if isinstance(tokens, list) else ord(tokens)


def _call_fixture(fn, owner, ns, rec, depth):
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    args = [_resolve(p, owner, ns, rec, {}, depth + 1) for p in params]
    if "request" in params and hasattr(fn, "_vllm_param"):
        args[params.index("request")].param = fn._vllm_param
    return fn(*args)


def _rows(fn_tables):
    """The cartesian product of a function's parametrize tables, as dicts."""
    per = []
    for t in fn_tables:
        rows = []
        for row in t["values"]:
            vals = row.values if isinstance(row, Param) else (row if isinstance(row, tuple) and len(t["names"]) > 1
                                                              else (row,))
            rows.append(dict(zip(t["names"], vals)))
        per.append(rows)
    for combo in itertools.product(*per):
        out = {}
        for d in combo:
            out.update(d)
        yield out


def _detokenize_incrementally(tokenizer, all_input_ids, prev_tokens=None, prefix_offset=0, read_offset=0, **k):
    """vLLM's incremental detokenizer over the one-token-per-character tokenizer: the new token's character."""
    c = chr(all_input_ids[-1])
    return [c], c, 0, 0


# vLLM / library helpers the streaming tests call, as the recording needs them: text through the one-character
# tokenizer, and partial_json_parser.ensure_json on a finished arguments text (the folded text: unchanged)
STREAM_HELPERS = {"detokenize_incrementally": _detokenize_incrementally,
                  "ensure_json": lambda text, *a, **k: text}
# a test module's own helper that only rewrites real token ids (mistral: the [TOOL_CALLS] text tokens to its
# control token): with one token per character the text, and so the ids, stay as they are
MODULE_HELPERS = {"fix_tool_call_tokenization": lambda tokens, *a, **k: tokens}


def record_inline(path: Path, harmony=None) -> list[Vec]:
    rec = Recording(harmony)
    TABLES.clear()
    tree = _Asserts().visit(ast.parse(path.read_text()))
    ast.fix_missing_locations(tree)
    # the rewritten comparisons are needed while the module runs (a module-level `if __name__ == "__main__"`)
    ns: dict = {"__name__": "harvested", "__file__": str(path), "__builtins__": builtins, "_vllm_eq": _eq,
                "_vllm_check": _check, "_vllm_in": _in, "_vllm_not_in": _not_in}
    # the helpers and parser classes the module imports resolve to the recording ones
    helpers = {n: getattr(rec, n) for n in ("run_tool_extraction", "run_tool_extraction_nonstreaming",
                                            "run_tool_extraction_streaming", "run_reasoning_extraction",
                                            "run_reasoning_extraction_streaming")}
    def named_probe(name=None, *a):  # the registry lookup: the probe remembers which parser the test asked for
        return type("NamedProbe", (rec.ProbeParser,), {"vllm_name": name}) if isinstance(name, str) else \
            rec.ProbeParser

    manager = types.SimpleNamespace(get_tool_parser=named_probe, get_reasoning_parser=lambda *a: rec.ProbeParser)
    StubModule.extra = {**helpers, "_probe_parser": rec.ProbeParser, "ToolParserManager": manager,
                        "ReasoningParserManager": manager, **STREAM_HELPERS}
    if harmony is not None:
        def parse_chat_output(token_ids):
            v = Vec(harmony.decode(token_ids), None)
            rec.vectors.append(v)
            return P(v, (("attr", "reasoning"),)), P(v, (("attr", "content"),)), Stub()
        StubModule.extra.update(get_encoding=lambda *a: harmony, parse_chat_output=parse_chat_output)
    sys.modules["harvested"] = types.ModuleType("harvested")  # dataclasses look their module up there
    exec(compile(tree, str(path), "exec"), ns)
    ns.update({n: f for n, f in MODULE_HELPERS.items() if n in ns})
    ns.update({"_vllm_eq": _eq, "_vllm_check": _check, "_vllm_in": _in, "_vllm_not_in": _not_in,
               "json": _json_shim(), "len": _len, "range": _range, "print": lambda *a, **k: None})
    tables: dict[str, list] = {}
    for t in TABLES:
        tables.setdefault(t["func"], []).append(t)
    funcs = [(None, n, f) for n, f in ns.items() if n.startswith("test") and inspect.isfunction(f)]
    for cn, cls in ns.items():
        if isinstance(cls, type) and cn.startswith("Test"):
            inst = cls.__new__(cls)
            funcs += [(inst, n, getattr(inst, n)) for n in dir(cls) if n.startswith("test")
                      and inspect.isfunction(getattr(cls, n))]
    for owner, name, fn in funcs:
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        for row in _rows(tables.get(fn.__qualname__, [])):
            start = len(rec.vectors)

            def attempt(plan):
                del rec.vectors[start:]
                rec.streams.clear()
                rec.plan = plan
                STATE["failures"] = 0
                random.seed(0)  # a test that cuts its text at random (granite4) cuts it the same way every run
                error = None
                try:
                    fn(*[_resolve(p, owner, ns, rec, row) for p in params])
                except Abort:
                    pass
                except Exception as e:  # needs more than the recording offers: its vectors so far count
                    error = e
                    if DEBUG:
                        print("  ", fn.__qualname__, plan and (plan["shape"], plan["k"]), type(e).__name__, e,
                              file=sys.stderr)
                return error

            INTERNAL_USE.clear()
            attempt(None)
            if rec.streams:
                counts = [st.calls for st in rec.streams]
                chosen = []
                for layout, shape in itertools.product(("split", "whole", "spread"), ("none", "empty")):
                    for k in range(6):
                        if layout == "spread" and min(counts) < max(2, 2 * k):
                            continue
                        plan = {"counts": counts, "shape": shape, "k": k, "layout": layout}
                        if attempt(plan) is None and not STATE["failures"] and \
                                [st.calls for st in rec.streams] == counts:
                            chosen.append((k, [v for v in rec.vectors[start:]]))
                    if chosen:
                        break
                if chosen:
                    ks = [k for k, _ in chosen]
                    vecs = chosen[0][1]
                    for st in (v for v in vecs if hasattr(v, "deltas")):
                        # the call count is pinned only when a single one meets all the test's assertions
                        if len(ks) == 1 and st.checks:
                            st.checks.append([[["attr", "tool_calls"], ["len"]], "==", ks[0]])
                    del rec.vectors[start:]
                    for v in vecs:  # one test case feeding the same text cut several ways is one vector
                        same = next((u for u in rec.vectors[start:] if hasattr(u, "deltas") and hasattr(v, "deltas")
                                     and (u.text, u.checks) == (v.text, v.checks)), None)
                        if same is not None:
                            same.sequences.append(v.deltas)
                            same.current_mismatch |= v.current_mismatch
                        else:
                            if hasattr(v, "deltas"):
                                v.sequences = [v.deltas]
                            rec.vectors.append(v)
                else:
                    attempt(None)
                    del rec.vectors[start:]  # its non-streaming part alone (if any) is not recorded either
                got = [v for v in rec.vectors[start:] if hasattr(v, "deltas") and v.checks]
                STREAM_REPORT.append((path.name, fn.__qualname__, "vector" if got else "internal" if INTERNAL_USE
                                      else "per-delta" if chosen else "unexpressed", sorted(INTERNAL_USE)))
                rec.plan = None
            for v in rec.vectors:
                if not hasattr(v, "func"):
                    v.func = fn.__qualname__
    return [v for v in rec.vectors if v.checks and isinstance(v.text, str)]


# per streaming test case: (file, test, what it yields, vLLM internals it read). "vector": a folded expectation;
# "internal": its assertions are only about vLLM's parser state; "per-delta": only about which delta carries what;
# "unexpressed": no folded result meets its assertions under the recording (printed, to be read by hand)
STREAM_REPORT: list[tuple] = []


def harvest(root: Path) -> list[dict]:
    StubModule.source_root = root
    sys.meta_path.insert(0, StubFinder())
    sys.modules["pytest"] = _pytest_module()
    for m in [m for m in sys.modules if m.split(".")[0] in StubFinder.ROOTS]:
        del sys.modules[m]
    vectors: list[dict] = []
    for rel, (parser, opens) in REASONING_FILES.items():
        vectors += _reasoning_vectors(rel, load(root / rel), parser, opens)
    for rel, parser in TOOL_FILES.items():
        ns = load(root / rel)
        vectors += _config_vectors(rel, ns, parser)
    known = {(v["reasoning_parser"], v["tool_parser"], v["model_output"]) for v in vectors}
    harmony = None
    ids = {v["id"] for v in vectors}
    for rel, (rparser, tparser, opens, uses_harmony) in INLINE_FILES.items():
        if uses_harmony and harmony is None:
            from openai_harmony import HarmonyEncodingName, load_harmony_encoding
            harmony = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        counts: dict[tuple, int] = {}
        file_tparser = tparser
        for v in record_inline(root / rel, harmony if uses_harmony else None):
            if file_tparser == BY_NAME:
                tparser = getattr(v, "parser_name", None)
                if tparser not in SHIPPED_TOOL_PARSERS:
                    continue
            streamed = hasattr(v, "deltas")
            if (rel, v.text) in UNASSERTED_TEXTS:
                continue
            if not v.text or (not streamed and (rparser, tparser, v.text) in known):  # no text, or known
                continue
            n = counts[(tparser, v.func)] = counts.get((tparser, v.func), 0) + 1
            vid = f"{tparser or rparser}/{v.func}#{n}"
            if vid in ids:  # a later file's test of the same name for the same parser: the file names it
                vid = f"{tparser or rparser}/{Path(rel).stem}::{v.func}#{n}"
            ids.add(vid)
            vec = {"id": vid, "source": f"{rel}::{v.func}",
                   "reasoning_parser": rparser, "tool_parser": tparser,
                   "prompt_opens_think": False if v.thinking_off else True if v.thinking_on and opens is False
                   else opens,
                   "model_output": v.text, "expect": {"checks": v.checks}}
            if streamed:  # the exact deltas vLLM's test fed (the chunking is part of the vector)
                vec["delta_sequences"] = v.sequences
                if v.current_mismatch:
                    print(f"  {vec['id']}: current_text is not previous_text + delta_text", file=sys.stderr)
            if v.tools:
                vec["tools"] = v.tools
            if v.answer_required:
                vec["chat_template_kwargs"] = {"force_nonempty_content": True}
            vectors.append(vec)
    seen, unique = set(), []
    for v in vectors:  # the same vector listed twice (streaming / non-streaming variants) counts once
        key = (v["reasoning_parser"], v["tool_parser"], v["model_output"], json.dumps(v["expect"], sort_keys=True),
               json.dumps(v.get("delta_sequences")))
        if key not in seen:
            seen.add(key)
            unique.append(v)
    return unique


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkout", type=Path)
    ap.add_argument("--commit", help="the checkout's vLLM commit (default: git rev-parse HEAD)")
    ap.add_argument("--out", type=Path, default=HERE / "tables.json")
    ap.add_argument("--debug", action="store_true", help="say why each test that yields no vector stopped")
    ap.add_argument("--file-sources", type=Path, help="JSON: per file read, the revision it was taken from")
    a = ap.parse_args()
    commit = a.commit or subprocess.run(["git", "-C", str(a.checkout), "rev-parse", "HEAD"], capture_output=True,
                                        text=True).stdout.strip()
    vectors = harvest(a.checkout)
    meta = {"repository": "https://github.com/vllm-project/vllm", "commit": commit, "license": "Apache-2.0"}
    if a.file_sources:
        files = json.loads(a.file_sources.read_text())
        read = sorted({*REASONING_FILES, *TOOL_FILES, *INLINE_FILES})
        missing = [f for f in read if f not in files]
        assert not missing, f"no source given for {missing}"
        meta["files"] = {f: files[f] for f in read}
    a.out.write_text(json.dumps({**meta, "vectors": vectors}, ensure_ascii=False, indent=1) + "\n")
    print(f"{len(vectors)} vectors -> {a.out}")
    if a.debug:
        for row in sorted(set((f, t, kind, ", ".join(attrs)) for f, t, kind, attrs in STREAM_REPORT)):
            print(*row, sep="\t")


if __name__ == "__main__":
    main()
