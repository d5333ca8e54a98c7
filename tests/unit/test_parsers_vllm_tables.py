"""vLLM's own parser test vectors (vendored in tests/data/vllm_parser_tables/, see NOTICE.md there) run through our
parsers whole, in the exact deltas vLLM's streaming tests feed (where the vector has them), in random splits and in
one-character deltas. Every vector passes, or is one of the intentional
differences listed in docs/parser-conformance.md — the test asserts that exact set, so a newly failing vector fails
here and a fixed one must come off the list."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from serve_app.conversation import ReasoningPart, TextPart, ToolCallPart
from serve_app.parsers import answer_required, fold_complete, parse_complete
from test_parsers_formats import check_events, stream

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests/data/vllm_parser_tables"
DOC = ROOT / "docs/parser-conformance.md"


VECTORS = json.loads((DATA / "tables.json").read_text())["vectors"]
# the files of the harvests before December 2026's new families: the formats issue 15 named
FIRST_FILES = {
    *(f"tests/reasoning/test_{n}_reasoning_parser.py" for n in (
        "qwen3", "deepseekr1", "deepseekv3", "gptoss", "glm4_moe", "minimax_m2", "mistral", "nemotron_v3", "kimi_k2",
        "glm47", "kimi_k25")),
    *(f"tests/tool_parsers/test_{n}_tool_parser.py" for n in (
        "deepseekv3", "deepseekv31", "deepseekv32", "deepseekv4", "qwen3xml", "qwen3coder", "kimi_k2", "pythonic",
        "mistral", "glm4_moe", "glm47_moe", "hermes", "llama3_json", "minimax_m2", "openai")),
    "tests/entrypoints/openai/parser/test_harmony_utils.py", "tests/tool_parsers/test_qwen3_xml_coder_shared.py",
    "tests/tool_parsers/test_qwen36_bugs.py", "tests/tool_parsers/test_glm47_final_delta_bug.py",
    "tests/reasoning/test_qwen3_tool_call_recovery.py", "tests/reasoning/test_issue_35221.py",
    "tests/tool_parsers/test_format_conformance.py",
}


def documented_exceptions() -> set[str]:
    """The vector ids in the doc's exceptions table: rows of the form | `id` | reason |."""
    return set(re.findall(r"^\| `([^`]+)` \|", DOC.read_text(), re.M))


def kwargs(v: dict) -> dict:
    return {"reasoning": v["reasoning_parser"], "tools": v["tool_parser"], "tool_schemas": v.get("tools"),
            "starts_in_reasoning": v["prompt_opens_think"],
            # the request's force_nonempty_content; thinking off is recorded as a prompt that does not open the block
            "answer_required": answer_required(v["reasoning_parser"], v.get("chat_template_kwargs"),
                                               False if v["prompt_opens_think"] is False else None)}


def outcome(parts) -> dict:
    return {"content": "".join(p.text for p in parts if isinstance(p, TextPart)),
            "reasoning": "".join(p.text for p in parts if isinstance(p, ReasoningPart)),
            "calls": [{"name": p.name, "arguments": json.loads(p.arguments), "id": p.id} for p in parts
                      if isinstance(p, ToolCallPart)]}


_MISSING = object()
_VACUOUS = object()  # an element the test's own loop would not have reached


def _as_vllm(got: dict) -> dict:
    """Our outcome in the shape vLLM's tests assert on (ExtractedToolCallInformation / (reasoning, content))."""
    calls = [{"type": "function", "id": c["id"],
              "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
             for c in got["calls"]]
    return {"content": got["content"], "reasoning": got["reasoning"], "tool_calls": calls,
            "tools_called": bool(calls)}


def _walk(obj, path):
    for step in path:
        kind = step[0]
        try:
            if kind == "attr":
                obj = obj[step[1]] if isinstance(obj, dict) else _MISSING
            elif kind == "item":
                obj = obj[step[1]] if isinstance(obj, (dict, list, str)) else _MISSING
            elif kind == "iter":  # recorded from a loop over the list: only the elements it has are checked
                if isinstance(obj, list) and step[1] >= len(obj):
                    return _VACUOUS
                obj = obj[step[1]] if isinstance(obj, list) else _MISSING
            elif kind == "len":
                obj = len(obj)
            elif kind == "json":
                obj = json.loads(obj)
        except (KeyError, IndexError, TypeError, ValueError):
            obj = _MISSING
        if obj is _MISSING:
            return _MISSING
    return obj


def _same(got, want, path) -> bool:
    if path and path[-1] == ["attr", "arguments"] and isinstance(got, str) and isinstance(want, str):
        try:  # formatting of the arguments JSON is not part of the contract; vLLM's "" (no arguments) is our {}
            return json.loads(got) == json.loads(want or "{}")
        except ValueError:
            return False
    if path and path[0][1] in ("content", "reasoning") and len(path) == 1:
        return (got or "") == (want or "")  # vLLM's None is our empty text
    if isinstance(want, list) and any(isinstance(w, dict) and w.get("_type") for w in want):
        # a whole list of calls compared at once (hunyuan_a13b): element by element, as below
        return isinstance(got, list) and len(got) == len(want) and all(_same(g, w, path) for g, w in zip(got, want))
    if isinstance(want, dict) and want.get("_type") == "ToolCall":
        want = want.get("function") or {}
        got = got.get("function") if isinstance(got, dict) else None
    if isinstance(want, dict) and want.get("_type") == "FunctionCall":  # a whole call compared at once
        return (isinstance(got, dict) and got.get("name") == want.get("name")
                and _same(got.get("arguments"), want.get("arguments"), [["attr", "arguments"]]))
    return got == want


def _check(got: dict, check) -> str | None:
    path, op, want = check
    if path and path[-1] in (["attr", "type"], ["attr", "index"]) or (
            ["attr", "id"] in path and not isinstance(want, str)):
        return None  # protocol details of vLLM's objects, not parsing
    value = _walk(_as_vllm(got), path)
    if value is _VACUOUS:
        return None
    if op == "truthy":
        ok = value is not _MISSING and bool(value) == want
    elif op in ("==", "!="):
        ok = value is not _MISSING and _same(value, want, path) == (op == "==")
    elif op in ("contains", "not contains"):
        ok = value is not _MISSING and isinstance(value, (str, list, dict)) and (want in value) == (op == "contains")
    else:
        raise AssertionError(op)
    return None if ok else f"{path} {op} {want!r}: got {('<missing>' if value is _MISSING else value)!r}"


def mismatch(v: dict, got: dict) -> str | None:
    """Why `got` does not meet the vector's expectation (None when it does). vLLM's None content is our ""."""
    e = v["expect"]
    for c in e.get("checks", ()):
        if why := _check(got, c):
            return why
    if "content" in e and (e["content"] or "") != got["content"]:
        return f"content {got['content']!r} != {e['content']!r}"
    if "reasoning" in e and (e["reasoning"] or "") != got["reasoning"]:
        return f"reasoning {got['reasoning']!r} != {e['reasoning']!r}"
    calls = got["calls"]
    if "calls" in e:
        want = e["calls"]
        if len(want) != len(calls):
            return f"{len(calls)} calls != {len(want)}: {calls}"
        for w, c in zip(want, calls):
            if w["name"] != c["name"] or ("arguments" in w and w["arguments"] != c["arguments"]):
                return f"call {c} != {w}"
    if "call_names" in e and [c["name"] for c in calls] != e["call_names"]:
        return f"call names {[c['name'] for c in calls]} != {e['call_names']}"
    if "call_count" in e and len(calls) != e["call_count"]:
        return f"{len(calls)} calls != {e['call_count']}"
    for sub, c in zip(e.get("args_subset", ()), calls):
        if any(c["arguments"].get(k) != val for k, val in sub.items()) or (not sub and c["arguments"]):
            return f"arguments {c['arguments']} do not contain {sub}"
    return None


def vllm_cuts(v: dict) -> list[list[int]]:
    """The cut points of each delta sequence vLLM's streaming test fed (its chunking is part of the vector)."""
    out = []
    for deltas in v.get("delta_sequences", ()):
        assert "".join(deltas) == v["model_output"]
        ends, at = [], 0
        for d in deltas[:-1]:
            at += len(d)
            ends.append(at)
        out.append(ends)
    return out


def run(v: dict) -> tuple[dict, str | None]:
    """The vector's outcome (the whole text; for a streaming vector, each of vLLM's delta sequences, folded) and
    why it does not meet the expectation."""
    events = parse_complete(v["model_output"], **kwargs(v))
    check_events(events)
    got = outcome(fold_complete(events))
    why = mismatch(v, got)
    for cuts in vllm_cuts(v):
        events = stream(v["model_output"], cuts, **kwargs(v))
        check_events(events)
        why = why or mismatch(v, outcome(fold_complete(events)))
    return got, why


def test_vendored_tables_are_whole():
    meta = json.loads((DATA / "tables.json").read_text())
    assert meta["repository"] == "https://github.com/vllm-project/vllm" and len(meta["commit"]) == 40
    # the tree is assembled from several revisions: every source file names the one it came from
    assert all(len(f["commit"]) == 40 for f in meta.get("files", {}).values())
    assert {v["source"].split("::")[0] for v in VECTORS} <= set(meta.get("files") or {v["source"].split("::")[0]
                                                                                      for v in VECTORS})
    ids = [v["id"] for v in VECTORS]
    assert len(ids) == len(set(ids))
    assert len(VECTORS) >= 300
    streamed = [v for v in VECTORS if "delta_sequences" in v]
    assert len(streamed) >= 70 and all(all(seq for seq in v["delta_sequences"]) for v in streamed)


def test_pass_rate_and_exact_exceptions():
    failing = {v["id"]: why for v in VECTORS if (why := run(v)[1])}
    documented = documented_exceptions()
    assert set(failing) == documented, {"undocumented failures": {k: failing[k] for k in set(failing) - documented},
                                        "documented but passing": sorted(documented - set(failing))}
    # Issue 15 asks for 98%; the intentional differences (docs/parser-conformance.md) leave 96.0% of all vectors and
    # 96.9% of the first 446 (the formats the issue named). These floors keep what is reached; raising them needs a
    # decision to change a documented rule (more vectors bring the same kinds of difference).
    assert len(VECTORS) - len(failing) >= 0.959 * len(VECTORS), f"{len(failing)} of {len(VECTORS)} vectors differ"
    first = [v for v in VECTORS if v["source"].split("::")[0] in FIRST_FILES]
    assert sum(v["id"] not in failing for v in first) >= 0.968 * len(first)


@pytest.mark.parametrize("v", VECTORS, ids=[v["id"] for v in VECTORS])
def test_split_invariant(v):
    """Random splits and one-character deltas fold to what the whole text gives (pass or documented fail alike)."""
    text = v["model_output"]
    kw = kwargs(v)
    want, _ = run(v)
    rng = random.Random(v["id"])
    n = len(text)
    splits = [sorted(rng.sample(range(1, n), min(n - 1, rng.randint(1, 8)))) for _ in range(20)] if n > 1 else []
    for cuts in [*vllm_cuts(v), *splits, list(range(1, n))]:
        events = stream(text, cuts, **kw)
        check_events(events)
        assert _no_random_ids(outcome(fold_complete(events))) == _no_random_ids(want), cuts


def _no_random_ids(got: dict) -> dict:
    """Our generated ids differ per request; a model's own ids (Kimi, Mistral) must not."""
    return {**got, "calls": [{**c, "id": None if c["id"].startswith("call_") else c["id"]} for c in got["calls"]]}
