"""DeepSeek-V3.2's, V4's and V4.1's templates (serve_app/families/templates/deepseek-v3.2.jinja, deepseek-v4*.jinja)
against the encoders vLLM serves the models with. DeepSeek ships their prompt formats as Python, not as chat
templates; each family's template
is this project's reproduction of vLLM's encoder and the kwargs its tokenizer wrapper reads, so every render must
equal the encoder's (or both must refuse the conversation): vLLM's own V4 fixture conversations (tests/data/
deepseek_v4, see its NOTICE.md) and seeded random ones — system, developer and latest_reminder messages, user runs,
reasoning, calls with every kind of argument value, results out of call order, DeepSeek's task markers, request and
message-level tools, a response format, prefix completion — under every combination of the kwargs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from serve_app.families import get_family
from serve_app.prompt import load_tokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "deepseek_v4"
FAMILIES = ["deepseek-v3.2", "deepseek-v4", "deepseek-v4.1"]


@pytest.fixture(scope="module", params=FAMILIES)
def tokenizers(request):
    """(family, SmolLM2's tokenizer, the same wrapped by vLLM's encoder for the family)."""
    from vllm.tokenizers.deepseek_v32 import get_deepseek_v32_tokenizer
    from vllm.tokenizers.deepseek_v4 import get_deepseek_v4_tokenizer
    from vllm.tokenizers.deepseek_v41 import get_deepseek_v41_tokenizer

    from serve_app.engine.provision import default_tokenizer_source

    path = default_tokenizer_source()
    wrap = {"deepseek-v3.2": get_deepseek_v32_tokenizer, "deepseek-v4": get_deepseek_v4_tokenizer,
            "deepseek-v4.1": get_deepseek_v41_tokenizer}[request.param]
    return get_family(request.param), load_tokenizer(path), wrap(load_tokenizer(path))


def both(tokenizers, messages, tools, kwargs) -> tuple[str, str]:
    """(ours, vLLM's): each a render, or "raised" where it refused the conversation."""
    family, ours, vllms = tokenizers
    out = []
    for render in (lambda: ours.apply_chat_template(messages, tools=tools, tokenize=False,
                                                    chat_template=family.template_text(), **kwargs),
                   lambda: vllms.apply_chat_template(json.loads(json.dumps(messages)), tools=tools, tokenize=False,
                                                     **kwargs)):
        try:
            out.append(render())
        except Exception:  # noqa: BLE001 - both must refuse the same conversations
            out.append("raised")
    return out[0], out[1]


def parsed(messages: list[dict]) -> list[dict]:
    """Arguments as objects, as vLLM's chat parsing hands them to a template (and this service does)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [{**tc, "function": {**tc["function"], "arguments": json.loads(
                tc["function"]["arguments"])}} for tc in m["tool_calls"]]}
        out.append(m)
    return out


KWARGS = [{}, {"thinking": True}, {"thinking": False}, {"enable_thinking": True}, {"enable_thinking": False},
          {"reasoning_effort": "max"}, {"reasoning_effort": "none"}, {"thinking": True, "reasoning_effort": "medium"},
          {"thinking": True, "drop_thinking": False}]


@pytest.mark.parametrize("case", [1, 2, 3, 4])
@pytest.mark.parametrize("kwargs", KWARGS, ids=json.dumps)
def test_vllm_s_fixture_conversations_render_as_vllm_s_encoder_renders_them(tokenizers, case, kwargs):
    data = json.loads((DATA / f"test_input_{case}.json").read_text(encoding="utf-8"))
    messages, tools = (data["messages"], data.get("tools")) if isinstance(data, dict) else (data, None)
    if tokenizers[0].name != "deepseek-v4":  # only V4 has the latest_reminder role (the others' encoders refuse it)
        messages = [m for m in messages if m["role"] != "latest_reminder"]
    ours, vllms = both(tokenizers, parsed(messages), tools, kwargs)
    # V4.1's encoder refuses an effort of medium (the service maps it first: the catalog's effort_values); V3.2's in
    # thinking mode, an answer after the last user message without reasoning (V4's fixture 4 ends with one)
    last = messages[-1]
    thinking = kwargs.get("thinking") or kwargs.get("enable_thinking")
    assert vllms != "raised" or (tokenizers[0].name == "deepseek-v4.1" and kwargs.get("reasoning_effort") == "medium") \
        or (tokenizers[0].name == "deepseek-v3.2" and thinking and last["role"] == "assistant"
            and not last.get("reasoning") and not last.get("tool_calls"))
    assert ours == vllms


def _value(rng: random.Random):
    return rng.choice([
        "plain", "ünïcödé 文件 \"quoted\" back\\slash\nnew line", "", " padded ", "{\"looks\": \"like json\"}",
        0, -7, 3.25, 1e-9, True, False, None, [], [1, "two", None], {}, {"nested": {"a": [True, 2.5]}, "k": "v"},
    ])


def _call(rng: random.Random, n: int) -> dict:
    args = {f"p{j}": _value(rng) for j in range(rng.randint(0, 3))}
    call = {"type": "function", "function": {"name": rng.choice(["read_file", "grep", "run"]), "arguments": args}}
    if rng.random() < 0.9:
        call["id"] = f"call_{n}"
    return call


TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


def _conversation(rng: random.Random, family: str) -> tuple[list[dict], list | None, dict]:
    msgs: list[dict] = []
    if rng.random() < 0.7:
        msgs.append({"role": "system", "content": rng.choice(["You are a coding agent.", ""])})
    if rng.random() < 0.2 and family == "deepseek-v4":
        msgs.append({"role": "latest_reminder", "content": "2026-12-06, Berlin"})
    calls = 0
    for turn in range(rng.randint(1, 4)):
        if rng.random() < 0.3:
            msgs.append({"role": "developer", "content": f"Developer note {turn}."})
        for j in range(rng.choice([1, 1, 1, 2])):
            user = {"role": "user", "content": f"Question {turn}.{j}"}
            if rng.random() < 0.05:
                user["task"] = rng.choice(["action", "query", "title"])
            msgs.append(user)
        if rng.random() < 0.1:
            msgs.append({"role": "system", "content": f"Later system {turn}."})
        while True:
            answer: dict = {"role": "assistant"}
            if rng.random() < 0.8:
                answer["reasoning"] = rng.choice([f"Thinking {turn}.", ""])
            made = [_call(rng, calls + k) for k in range(rng.choice([0, 0, 1, 2, 3]))]
            calls += len(made)
            answer["content"] = rng.choice(["", f"Answer {turn}.", None] if made else [f"Answer {turn}.", ""])
            if made:
                answer["tool_calls"] = made
            msgs.append(answer)
            if not made:
                break
            results = [{"role": "tool", "tool_call_id": c.get("id", ""), "content": f"result of {c.get('id')}"}
                       for c in made]
            rng.shuffle(results)
            msgs += results
            if rng.random() < 0.2:
                msgs.append({"role": "user", "content": "Text beside the results."})
            if rng.random() < 0.5:
                break
    if rng.random() < 0.5 and msgs[-1]["role"] == "assistant":
        msgs.append({"role": "user", "content": "Next question."})
    elif msgs[-1]["role"] == "assistant" and rng.random() < 0.2:
        msgs[-1]["prefix"] = True  # DeepSeek's prefix completion: the answer is continued (V3.2 reads it)
    if family == "deepseek-v3.2" and rng.random() < 0.05:
        msgs.insert(0, {"role": "tool", "tool_call_id": "call_x", "content": "a result first"})  # the encoder's index-0 case
    tools = None
    if rng.random() < 0.5:
        tools = [TOOL]
    elif rng.random() < 0.2:
        holder = next((m for m in msgs if m["role"] in ("system", "developer") and m["content"]), None)
        if holder is not None:
            holder["tools"] = [TOOL]
    if rng.random() < 0.15:
        holder = next((m for m in msgs if m["role"] in ("system", "developer") and m["content"]), None)
        if holder is not None:
            holder["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
                "type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "string"}}}}}
    kwargs = dict(rng.choice(KWARGS))
    if rng.random() < 0.3:
        kwargs["reasoning_effort"] = rng.choice(["low", "minimal", "high", "xhigh", "max", "none", "unexpected", 3,
                                                 80, 0, True])
    return msgs, tools, kwargs


@pytest.mark.parametrize("seed", range(12))
def test_random_conversations_render_as_vllm_s_encoder_renders_them(tokenizers, seed):
    rng = random.Random(f"{tokenizers[0].name}-{seed}")
    refused = 0
    for case in range(25):
        messages, tools, kwargs = _conversation(rng, tokenizers[0].name)
        ours, vllms = both(tokenizers, messages, tools, kwargs)
        assert ours == vllms, (seed, case, kwargs, [m["role"] for m in messages])
        refused += vllms == "raised"
    assert refused <= 12  # most conversations render (V3.2 refuses the most): the comparison is of prompts
