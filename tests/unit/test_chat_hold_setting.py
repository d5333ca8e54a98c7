"""`ingress.chat_tool_calls` and `nvext.hold_tool_calls` through the app: which Chat Completions requests get
their tool calls whole (and never one the parser abandons), and which get arguments as generated."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from serve_app.ingress.context import IngressContext
from serve_app.ingress.server import create_app
from serve_app.service import GenerationService
from serve_app.settings import AppSettings
from tests.support.scripted_engines import ScriptedEngines

CALL = '<tool_call>\n{"name": "write", "arguments": {"path": "a.py", "content": "print(1)\\n"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}]


def _app(chat_tool_calls: str | None):
    from serve_app.engine.provision import ensure_model

    ingress = {"direct_ingress": True} | ({"chat_tool_calls": chat_tool_calls} if chat_tool_calls else {})
    cfg = AppSettings.model_validate({"engine_placement": "ingress", "ingress": ingress, "models": [
        {"id": "m", "source": "smollm2-135m-instruct", "tool_parser": "hermes",
         "chat_template": "serve_app/templates/smollm2_tools.jinja"}]})
    engines = ScriptedEngines()
    path = ensure_model("smollm2-135m-instruct")
    return create_app(IngressContext(settings=cfg, service=GenerationService(cfg, engines, model_paths={"m": path}),
                                     secret=b"s" * 32)), engines


async def _call_deltas(app, nvext: dict | None) -> list[dict]:
    body = {"model": "m", "stream": True, "tools": TOOLS, "messages": [{"role": "user", "content": "write it"}]}
    if nvext is not None:
        body["nvext"] = nvext
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls") or []]


@pytest.mark.parametrize("setting, nvext, held", [
    (None, None, False),  # the default streams arguments as generated, as OpenAI does
    (None, {"hold_tool_calls": True}, True),
    ("hold", None, True),
    ("hold", {"hold_tool_calls": False}, False),  # the request chooses for itself
    ("stream", {"hold_tool_calls": None}, False),
])
def test_who_gets_calls_whole(setting, nvext, held):
    app, engines = _app(setting)
    engines.script = "Writing." + CALL
    seen = set()
    for seed in range(6):  # several splits: held or not must not depend on where the deltas fall
        engines.split_seed = seed
        deltas = asyncio.run(_call_deltas(app, nvext))
        args = [d["function"]["arguments"] for d in deltas if d["function"].get("arguments")]
        assert json.loads("".join(args)) == {"path": "a.py", "content": "print(1)\n"}
        seen.add(len(args))
        if held:
            assert len(args) == 1
    if not held:
        assert max(seen) > 1  # some split streamed the arguments in pieces


def test_a_held_call_cut_off_by_the_limit_is_never_sent():
    app, engines = _app("hold")
    engines.script, engines.finish = "Writing." + CALL[:60], "length"
    for seed in range(6):
        engines.split_seed = seed
        assert asyncio.run(_call_deltas(app, None)) == []
