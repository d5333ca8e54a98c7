"""Streaming folded by the real SDKs equals the non-streaming answer, per family and API, for random model turns.

Each case is a random assistant turn (reasoning, text and calls whose arguments mix quotes, backslashes, newlines,
markup characters, emoji, numbers, nested objects) written as the family's model writes it (the family's real
template renders the turn: tests/support/stability.emitted_text), sometimes cut off at a random point by the
token limit, and fed through the real app and service by a stub engine in random splits. The same request is made
streaming and not through the `anthropic` and `openai` SDKs; the SDK's own accumulator folds the stream. Anthropic
and Responses must agree exactly, cut-offs included (a call the limit cut off is never sent on either:
conversation.HeldCalls), and so must Chat Completions with `nvext.hold_tool_calls`; without it Chat streams
arguments as generated, so it must agree where the turn ended on its own. What a turn's parse should be is tests/unit/test_families_prefix.py's and test_families.py's concern;
this is the encoders' and the SDKs' side.
"""

from __future__ import annotations

import asyncio
import json
import random

import anthropic
import httpx
import httpx2
import openai
import pytest

from serve_app.families import load_catalog
from serve_app.ingress.context import IngressContext
from serve_app.ingress.server import create_app
from serve_app.parsers import TOOL_PARSERS
from serve_app.parsers.formats import tool_start_markers
from serve_app.service import GenerationService
from serve_app.settings import AppSettings
from tests.support.scripted_engines import ScriptedEngines
from tests.support.family_sessions import HEADER, SECRET, SYSTEM, TOOLS, USER, family_renderer, thinking_cases, \
    turn_parts
from tests.support.stability import agent_request, api_conversation, emitted_text

CATALOG = load_catalog()
FAMILIES = sorted(CATALOG)
CASES_PER_FAMILY = 12
CHARS = list("aZ \n\"\\'<>{}[]:,=&/*-01\t") + ["é", "λ", "😀"]


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(CHARS) for _ in range(rng.randint(0, n)))


def _value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if r < 0.4 or depth > 2:
        return _text(rng, 20)
    if r < 0.55:
        return rng.randint(-10 ** 6, 10 ** 6)
    if r < 0.62:
        return rng.choice([True, False, None])
    if r < 0.7:
        return round(rng.uniform(-100, 100), 3)
    if r < 0.85:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {(_text(rng, 6) or "k"): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _calls(rng: random.Random) -> list:
    calls = []
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        name = rng.choice(["ls", "read_file"])
        args = {"path": _text(rng, 30)} if name == "ls" else {"path": _text(rng, 30), "limit": rng.randint(0, 10 ** 9)}
        if rng.random() < 0.3:
            args["extra"] = _value(rng)
        calls.append((name, args))
    return calls


_IDS = {"id", "signature", "encrypted_content", "created_at", "call_id", "parsed", "parsed_arguments", "completed_at"}


def _strip(value):
    """Without what differs between any two answers (ids, times, signatures) or only exists in the SDK's parse."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in _IDS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


@pytest.fixture(scope="module")
def served():
    from serve_app.engine.provision import ensure_model

    path = ensure_model("smollm2-135m-instruct")
    cfg = AppSettings.model_validate({"engine_placement": "ingress", "ingress": {"direct_ingress": True}, "models": [
        {"id": f, "family": f, "family_template": True, "max_model_len": 8192, "max_output_tokens": 1024}
        for f in FAMILIES]})
    engines = ScriptedEngines()
    app = create_app(IngressContext(settings=cfg, service=GenerationService(cfg, engines, model_paths={
        f: path for f in FAMILIES}), secret=SECRET))
    return app, engines, {f: family_renderer(path, CATALOG[f]) for f in FAMILIES}


async def _answers(app, api: str, body: dict) -> tuple[dict, dict]:
    """(non-streaming answer, the stream as the SDK folds it), without ids, times and signatures."""
    if api == "anthropic":
        client = anthropic.AsyncAnthropic(api_key="x", base_url="http://t", max_retries=0,
                                          http_client=httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app)))
        args = {**body, "max_tokens": 512}
        whole = (await client.messages.create(**args)).model_dump()
        async with client.messages.stream(**args) as stream:
            folded = (await stream.get_final_message()).model_dump()
        return ({"content": _strip(whole["content"]), "stop": whole["stop_reason"]},
                {"content": _strip(folded["content"]), "stop": folded["stop_reason"]})
    client = openai.AsyncOpenAI(api_key="x", base_url="http://t/v1", max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))
    if api == "responses":
        whole = (await client.responses.create(**body)).model_dump()
        async with client.responses.stream(**body) as stream:
            folded = (await stream.get_final_response()).model_dump()
        return tuple({k: _strip(r[k]) for k in ("output", "status", "incomplete_details")} for r in (whole, folded))
    args = dict(body)
    extra = {key: args.pop(key) for key in ("chat_template_kwargs", "nvext") if key in args}
    whole = await client.chat.completions.create(**args, extra_body=extra)
    content, reasoning, calls, finish = "", "", {}, None
    async for chunk in await client.chat.completions.create(**args, stream=True, extra_body=extra):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                call["name"] += (tc.function and tc.function.name) or ""
                call["arguments"] += (tc.function and tc.function.arguments) or ""
            finish = choice.finish_reason or finish
    msg = whole.choices[0].message
    return ({"content": msg.content or "", "reasoning": (msg.model_extra or {}).get("reasoning_content") or "",
             "calls": [{"name": t.function.name, "arguments": t.function.arguments} for t in msg.tool_calls or []],
             "finish": whole.choices[0].finish_reason},
            {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)], "finish": finish})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_stream_folds_to_the_complete_answer(served, family):
    app, engines, renderers = served
    fam, renderer = CATALOG[family], renderers[family]
    rng = random.Random(family)
    starts = tool_start_markers(TOOL_PARSERS[fam.tool_parser])
    for case in range(CASES_PER_FAMILY):
        api, held = (("anthropic", True), ("responses", True), ("chat", False), ("chat", True))[case % 4]
        thinking = rng.choice(thinking_cases(fam))
        body = {**agent_request(api, thinking, SYSTEM, USER, TOOLS, HEADER), "model": family}
        conv, opts = api_conversation(api, body, SECRET)
        if api == "chat":
            body["nvext"] = {"hold_tool_calls": held}
        parts = turn_parts(fam, thinking, _text(rng, 80) or "hm", _text(rng, 60), _calls(rng), 0)
        _, script, _ = emitted_text(renderer, conv, parts, opts, fam.turn_ends(renderer.tokenizer.eos_token), starts)
        engines.finish = "stop"
        if rng.random() < 0.35 and len(script) > 2:
            script, engines.finish = script[:rng.randint(1, len(script) - 1)], "length"
        engines.script, engines.split_seed = script, rng.randint(0, 10 ** 9)
        whole, folded = asyncio.run(_answers(app, api, body))
        if not held:  # an abandoned call's arguments went out as generated; every finished call is among them
            assert {k: folded[k] for k in ("content", "reasoning", "finish")} == \
                {k: whole[k] for k in ("content", "reasoning", "finish")}
            sent = iter(folded["calls"])
            assert all(call in sent for call in whole["calls"]), (whole["calls"], folded["calls"])
            continue
        assert folded == whole, f"{family} {api} held={held} thinking={thinking} finish={engines.finish}\n{script!r}"
        if api == "chat":
            assert all(isinstance(json.loads(c["arguments"]), dict) for c in whole["calls"])
