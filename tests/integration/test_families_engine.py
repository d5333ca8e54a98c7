"""Each model family through the real engine: SmolLM2's weights served under the family's real template and
parsers (the `family-*` models of tests/configs/test.yaml, all on the shared 8K engine), one tool-loop session per
family through a real SDK (the three APIs in turn), the engine forced to say the family's own wire format — what
the family's template renders for the turn, i.e. what a model trained on it emits. The Responses and Chat sessions
open with a developer message after the instructions, as Codex does (templates that take one system message get
them joined: ReplayPolicy.merge_leading_system).

Turn 1 (thinking, calls) must come back as the SDK's thinking / tool-use objects with the exact arguments; turn 2
(the tool results sent back as that client sends them) must be rendered by the server exactly as locally (same
prompt token count), start with turn 1's prompt + the generated text, reuse the engine's KV cache for it, and its
forced answer must come back as thinking + text.
"""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest

from serve_app.conversation import ReasoningPart, TextPart, ToolCallPart
from serve_app.families import get_family, load_catalog
from tests.support.family_sessions import turn_parts
from serve_app.parsers import TOOL_PARSERS
from serve_app.parsers.formats import tool_start_markers
from serve_app.prompt import PromptRenderer, load_tokenizer
from tests.support.stability import api_conversation, check_turn, emitted_text
from serve_app.settings import AppSettings

pytestmark = pytest.mark.integration

BLOCK = 128  # vLLM's KV block on CPU
FAMILIES = sorted(load_catalog())
API_OF = {name: ("anthropic", "responses", "chat")[i % 3] for i, name in enumerate(FAMILIES)}
TOOLS = [("read_file", "Read a file.", {"type": "object", "properties": {"path": {"type": "string"},
                                                                         "limit": {"type": "integer"}},
                                        "required": ["path"]}),
         ("grep", "Search files.", {"type": "object", "properties": {"pattern": {"type": "string"},
                                                                     "regex": {"type": "boolean"}},
                                    "required": ["pattern"]})]
REASONING = ("The user wants the entry point. I should open the main module and search for the main function, "
             "because the README may be out of date and the code is the source of truth.")
TEXT = "Reading the main module."
CALLS = [("read_file", {"path": "src/main.py", "limit": 200}), ("grep", {"pattern": "def main\\(", "regex": True})]
ANSWER_REASONING = "Both results agree: main() is defined in src/main.py and returns 0."
ANSWER = "The entry point is main() in src/main.py."
RESULT = "def main():\n    return 0\n"
DEVELOPER = "Sandbox: workspace-write. Approvals: on-request."


@pytest.fixture(scope="module")
def renderers(serve_config):
    from serve_app.engine.provision import ensure_model
    from serve_app.keyring import for_tenant
    from serve_app.tenants import DEFAULT

    args = serve_config["applications"][0]["args"]
    settings = AppSettings.model_validate(args)
    out = {}
    for name in FAMILIES:
        model = settings.find_model(f"family-{name}")
        tok = load_tokenizer(ensure_model(model.model_source, settings.model_cache_dir), model.chat_template)
        out[name] = PromptRenderer(tok, model, strip_preamble=settings.ingress.strip_preamble)
    # The keys the server signs and seals the default tenant's items with (keyring.for_tenant).
    return out, for_tenant(args["ingress"]["server_secret"].encode(), DEFAULT)


def first_body(api: str, model: str, nonce: str) -> dict:
    system, user = f"[{nonce}] You are a coding agent.", "Where is the entry point?"
    if api == "anthropic":
        return {"model": model, "max_tokens": 1500, "system": system,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "tools": [{"name": n, "description": d, "input_schema": s} for n, d, s in TOOLS],
                "messages": [{"role": "user", "content": user}]}
    if api == "responses":
        return {"model": model, "instructions": system, "store": False, "include": ["reasoning.encrypted_content"],
                "reasoning": {"effort": "medium"}, "max_output_tokens": 1024,
                "tools": [{"type": "function", "name": n, "description": d, "parameters": s} for n, d, s in TOOLS],
                "input": [{"type": "message", "role": "developer",
                           "content": [{"type": "input_text", "text": DEVELOPER}]},
                          {"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]}]}
    return {"model": model, "max_tokens": 1024, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": n, "description": d, "parameters": s}}
                      for n, d, s in TOOLS],
            "messages": [{"role": "system", "content": system}, {"role": "developer", "content": DEVELOPER},
                         {"role": "user", "content": user}]}


def send(api: str, url: str, body: dict, script: str) -> dict:
    """One request through the API's real SDK, the engine forced to say `script`; the response as a dict."""
    extra = {"nvext": {"forced_script": script}}
    kwargs = {k: v for k, v in body.items()}
    if api == "anthropic":
        client = anthropic.Anthropic(base_url=url, api_key="test", max_retries=0, timeout=600)
        return client.messages.create(**kwargs, extra_body=extra).to_dict()
    client = openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=600)
    if api == "responses":
        return client.responses.create(**kwargs, extra_body=extra).to_dict()
    return client.chat.completions.create(**kwargs, extra_body=extra).to_dict()


def folded(api: str, resp: dict) -> tuple[str, str, list[tuple[str, dict]]]:
    """(reasoning, text, calls) as the SDK handed them over."""
    if api == "anthropic":
        blocks = resp["content"]
        return ("".join(b.get("thinking", "") for b in blocks if b["type"] == "thinking"),
                "".join(b["text"] for b in blocks if b["type"] == "text"),
                [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"])
    if api == "responses":
        items = resp["output"]
        reasoning = "".join(c.get("text", "") for i in items if i["type"] == "reasoning"
                            for c in (i.get("content") or []))
        text = "".join(c["text"] for i in items if i["type"] == "message" for c in i["content"]
                       if c["type"] == "output_text")
        return reasoning, text, [(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"]
    msg = resp["choices"][0]["message"]
    return (msg.get("reasoning_content") or msg.get("reasoning") or "", msg.get("content") or "",
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or []])


def next_body(api: str, body: dict, resp: dict) -> dict:
    nxt = json.loads(json.dumps(body))
    if api == "anthropic":
        calls = [b for b in resp["content"] if b["type"] == "tool_use"]
        nxt["messages"] += [{"role": "assistant", "content": resp["content"]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c["id"],
                                                          "content": RESULT} for c in calls]}]
    elif api == "responses":
        calls = [i for i in resp["output"] if i["type"] == "function_call"]
        nxt["input"] += [*resp["output"], *({"type": "function_call_output", "call_id": c["call_id"],
                                             "output": RESULT} for c in calls)]
    else:
        msg = {k: v for k, v in resp["choices"][0]["message"].items() if v is not None}
        nxt["messages"] += [msg, *({"role": "tool", "tool_call_id": c["id"], "content": RESULT}
                                   for c in msg["tool_calls"])]
    return nxt


def usage(api: str, resp: dict) -> tuple[int, int]:
    """(prompt tokens, of which served from the prefix cache)."""
    u = resp["usage"]
    if api == "anthropic":
        return u["input_tokens"] + (u.get("cache_read_input_tokens") or 0), u.get("cache_read_input_tokens") or 0
    if api == "responses":
        return u["input_tokens"], (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
    return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def expected(parts: list) -> tuple[str, str, list[tuple[str, dict]]]:
    return ("".join(p.text for p in parts if isinstance(p, ReasoningPart)),
            "".join(p.text for p in parts if isinstance(p, TextPart)),
            [(p.name, json.loads(p.arguments)) for p in parts if isinstance(p, ToolCallPart)])


def same(got: tuple, want: tuple) -> bool:
    """Reasoning and text up to the whitespace the template frames them with; calls exactly."""
    return (got[0].strip(), got[1].strip(), got[2]) == (want[0].strip(), want[1].strip(), want[2])


def session(url: str, renderers, name: str) -> None:
    rends, secret = renderers
    r = rends[name]
    fam = get_family(name)
    api = API_OF[name]
    starts = tool_start_markers(TOOL_PARSERS[fam.tool_parser])
    body = first_body(api, f"family-{name}", uuid.uuid4().hex[:12])

    conv, opts = api_conversation(api, body, secret)
    parts = turn_parts(fam, True, REASONING, TEXT, CALLS, 0)
    prompt_text, script, _ = emitted_text(r, conv, parts, opts, fam.turn_ends(r.tokenizer.eos_token), starts)
    resp = send(api, url, body, script)
    prompt = r.render_sync(conv, opts)
    assert usage(api, resp)[0] == len(prompt.token_ids), "the local render is not the server's"
    assert api == "anthropic" or DEVELOPER in prompt.text
    got = folded(api, resp)
    assert same(got, expected(parts)), f"{name} turn 1 via {api}: script {script!r} gave {got}"

    body2 = next_body(api, body, resp)
    conv2, opts2 = api_conversation(api, body2, secret)
    answer = turn_parts(fam, True, ANSWER_REASONING, ANSWER, [], 0)
    _, script2, _ = emitted_text(r, conv2, answer, opts2, fam.turn_ends(r.tokenizer.eos_token), starts)
    resp2 = send(api, url, body2, script2)
    prompt2 = r.render_sync(conv2, opts2)
    n2, cached2 = usage(api, resp2)
    assert n2 == len(prompt2.token_ids), "the local render is not the server's"
    assert prompt2.text.startswith(prompt_text + script), f"{name}: turn 2 does not replay turn 1 as generated"
    tok = r.tokenizer
    generated = tok.encode(script, add_special_tokens=False)
    result = check_turn(prompt.token_ids, generated, prompt2.token_ids)
    # Token-level: everything up to the generated text's last token (SmolLM2's tokenizer may merge that one with
    # the family's end-of-turn marker, which it does not know as a token); the engine's cache covers it by blocks.
    assert result.reused >= len(result.cached) - 1, result.diverges_at(tok)
    assert cached2 >= ((result.reused - 1) // BLOCK) * BLOCK
    got2 = folded(api, resp2)
    want2 = expected(answer)
    if want2[0] not in script2:  # DeepSeek-V3.1 does not think after a tool result: its template has no place for it
        assert fam.thinking_replay == "drops"
        want2 = ("", *want2[1:])
    assert same(got2, want2), f"{name} turn 2 via {api}: script {script2!r} gave {got2}"


@pytest.fixture(scope="module")
def outcomes(serve_url, renderers) -> dict:
    """All sessions at once (two CPU cores decode a batch of nine about as fast as one sequence)."""
    def outcome(name):
        try:
            session(serve_url, renderers, name)
        except Exception as e:  # noqa: BLE001 - re-raised by the family's own test
            return e
        return None

    with ThreadPoolExecutor(len(FAMILIES)) as pool:
        return dict(zip(FAMILIES, pool.map(outcome, FAMILIES)))


@pytest.mark.parametrize("name", FAMILIES)
def test_family_tool_loop_through_the_engine(outcomes, name):
    failure = outcomes[name]
    if failure is not None:
        raise failure


def _reasoning_of(d: dict) -> str:
    return d.get("reasoning_content") or d.get("reasoning") or ""


def test_nemotron_answers_with_its_reasoning_when_asked(serve_url):
    """vLLM's force_nonempty_content (OpenClaw's vLLM plugin sends it for Nemotron 3 with thinking off) and thinking
    off on nemotron_v3: a turn that is only reasoning comes back with its reasoning as the answer (complete: the
    answer alone; streamed: the reasoning, then the same text as content). Without either it stays reasoning."""
    thought = "The user asks for 2 + 2, which is 4."
    client = openai.OpenAI(base_url=serve_url + "/v1", api_key="test", max_retries=0, timeout=600)
    body = {"model": "family-nemotron-3", "max_tokens": 64, "messages": [{"role": "user", "content": "2 + 2?"}]}
    forced = {"nvext": {"forced_script": thought}}  # thinking on: the prompt opens the block, the model never closes it
    asked = {**forced, "chat_template_kwargs": {"force_nonempty_content": True}}

    plain = client.chat.completions.create(**body, extra_body=forced).to_dict()["choices"][0]
    assert (plain["message"].get("content") or "", _reasoning_of(plain["message"])) == ("", thought)

    done = client.chat.completions.create(**body, extra_body=asked).to_dict()["choices"][0]
    assert (done["message"]["content"], _reasoning_of(done["message"])) == (thought, "")
    assert done["finish_reason"] == "stop"

    deltas = [c.to_dict()["choices"][0]["delta"] for c in client.chat.completions.create(
        **body, extra_body=asked, stream=True) if c.choices]
    assert "".join(_reasoning_of(d) for d in deltas) == thought
    assert "".join(d.get("content") or "" for d in deltas) == thought
    first_text = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not _reasoning_of(d) for d in deltas[first_text:])  # the answer comes after all the reasoning

    # Responses takes the option in chat_template_kwargs too (vLLM's extension there): one message, no reasoning item
    resp = client.responses.create(model="family-nemotron-3", input="2 + 2?", max_output_tokens=64, store=False,
                                   extra_body=asked).to_dict()
    assert [i["type"] for i in resp["output"]] == ["message"]
    assert resp["output"][0]["content"][0]["text"] == thought

    # Thinking off (Anthropic without `thinking`): the prompt closes the block; a model that opens one anyway and
    # never closes it answers with that text, as vLLM's nemotron_v3 parser does with thinking off.
    claude = anthropic.Anthropic(base_url=serve_url, api_key="test", max_retries=0, timeout=600)
    msg = claude.messages.create(model="family-nemotron-3", max_tokens=64,
                                 messages=[{"role": "user", "content": "2 + 2?"}],
                                 extra_body={"nvext": {"forced_script": "<think>" + thought}}).to_dict()
    assert [(b["type"], b.get("text")) for b in msg["content"]] == [("text", thought)]
    assert msg["stop_reason"] == "end_turn"
