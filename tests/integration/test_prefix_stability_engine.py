"""Prefix stability through the real engine. For each served template × parser pair of the test config and each
API's history shape: send turn N with a forced script (the real vLLM engine emits exactly those tokens), build
turn N+1 from the raw response exactly as that client sends it back (Anthropic thinking/text/tool_use blocks +
tool_result; Responses output items with encrypted reasoning + function_call_output; Chat message with
reasoning_content/tool_calls + tool message), send it, and check two things:

- exact ids: the prompt of N+1 starts with N's prompt ids + the generated ids (the renderer is the server's own
  code and config; that it is the server's render is checked by its count equalling the engine's usage);
- the engine agrees: N+1's cached prompt tokens cover every full KV block of N's prompt + generated tokens
  (the script is longer than a CPU block, 128 tokens, so a divergence inside the generated part shows).

The reused-prefix fraction per pair is printed (`pytest -s`).
"""

from __future__ import annotations

import copy
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_app.prompt import PromptRenderer, load_tokenizer
from tests.support.stability import anthropic_conversation, chat_conversation, check_turn, responses_conversation
from serve_app.settings import AppSettings

pytestmark = pytest.mark.integration

BLOCK = 128  # vLLM's KV block on CPU
RESULT = "def main():\n    return 0\n"
TOOL = {"name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
REASONING = ("The user wants the entry point. I should open the main module first, then look at how the command "
             "line arguments are parsed, and only then answer, because the README may be out of date and the "
             "code is the source of truth. I will read src/main.py now and check the function named main, its "
             "return value, and whether it calls sys.exit anywhere in the module or in a helper it imports. After "
             "that I will summarise what I found in one short, precise sentence for the user, without guessing.")
TEXT = "I will read the main module first."
ANSWER = "The entry point is main() in src/main.py; it returns 0 and never calls sys.exit itself."
CALL = '{"name": "read_file", "arguments": {"path": "src/main.py"}}'

# model id -> (the script of a tool turn, the script of a plain answer); both in the template's canonical form.
PAIRS = {
    "smollm2-135m-instruct": (  # smollm2_tools.jinja, no reasoning parser, hermes
        f"{REASONING} {TEXT}<tool_call>\n{CALL}\n</tool_call>", f"{REASONING} {ANSWER}"),
    "test-qwen3": (  # smollm2_tools.jinja (reads reasoning_content), qwen3, hermes
        f"<think>{REASONING}</think>{TEXT}<tool_call>\n{CALL}\n</tool_call>", f"<think>{REASONING}</think>{ANSWER}"),
}
REPORT: list[tuple[str, str, str, int, int, float, int]] = []


@pytest.fixture(scope="module")
def renderers(serve_config):
    from serve_app.engine.provision import ensure_model
    from serve_app.keyring import for_tenant
    from serve_app.tenants import DEFAULT

    args = serve_config["applications"][0]["args"]
    settings = AppSettings.model_validate(args)
    out = {}
    for model_id in PAIRS:
        model = settings.find_model(model_id)
        tok = load_tokenizer(ensure_model(model.model_source, settings.model_cache_dir), model.chat_template)
        out[model_id] = PromptRenderer(tok, model, strip_preamble=settings.ingress.strip_preamble)
    # The keys the server signs and seals the default tenant's items with (keyring.for_tenant).
    return out, for_tenant(args["ingress"]["server_secret"].encode(), DEFAULT)


def post(url: str, body: dict) -> dict:
    r = httpx.post(url, json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


# -- the three clients: first request, conversion (for the local render) and the next request -------------------

def anthropic_first(model: str, nonce: str, script: str) -> dict:
    return {"model": model, "max_tokens": 1500, "system": [
        {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{nonce[:3]}; cc_entrypoint=cli;"},
        {"type": "text", "text": f"[{nonce}] You are a coding agent."}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}],
        "messages": [{"role": "user", "content": "Where is the entry point?"}], "nvext": {"forced_script": script}}


def anthropic_next(body: dict, resp: dict, script: str) -> dict:
    calls = [b for b in resp["content"] if b["type"] == "tool_use"]
    user = ([{"type": "tool_result", "tool_use_id": c["id"], "content": RESULT} for c in calls] if calls
            else "Thanks. And the tests?")
    nxt = copy.deepcopy(body)
    nxt["messages"] += [{"role": "assistant", "content": resp["content"]}, {"role": "user", "content": user}]
    nxt["nvext"] = {"forced_script": script}
    return nxt


def anthropic_cached(resp: dict) -> tuple[int, int]:
    u = resp["usage"]
    return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]


def responses_first(model: str, nonce: str, script: str) -> dict:
    return {"model": model, "instructions": f"[{nonce}] You are a coding agent.", "store": False,
            "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "medium"},
            "tools": [{"type": "function", **TOOL}], "max_output_tokens": 512,
            "input": [{"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Where is the entry point?"}]}],
            "nvext": {"forced_script": script}}


def responses_next(body: dict, resp: dict, script: str) -> dict:
    calls = [i for i in resp["output"] if i["type"] == "function_call"]
    follow = ([{"type": "function_call_output", "call_id": c["call_id"], "output": RESULT} for c in calls] if calls
              else [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks. And the tests?"}]}])
    nxt = copy.deepcopy(body)
    nxt["input"] = [*body["input"], *resp["output"], *follow]
    nxt["nvext"] = {"forced_script": script}
    return nxt


def responses_cached(resp: dict) -> tuple[int, int]:
    u = resp["usage"]
    return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]


def chat_first(model: str, nonce: str, script: str) -> dict:
    return {"model": model, "max_tokens": 512, "temperature": 0, "tools": [{"type": "function", "function": TOOL}],
            "messages": [{"role": "system", "content": f"[{nonce}] You are a coding agent."},
                         {"role": "user", "content": "Where is the entry point?"}],
            "nvext": {"forced_script": script}}


def chat_next(body: dict, resp: dict, script: str) -> dict:
    msg = {k: v for k, v in resp["choices"][0]["message"].items() if v is not None}
    follow = ([{"role": "tool", "tool_call_id": c["id"], "content": RESULT} for c in msg["tool_calls"]]
              if msg.get("tool_calls") else [{"role": "user", "content": "Thanks. And the tests?"}])
    nxt = copy.deepcopy(body)
    nxt["messages"] = [*body["messages"], msg, *follow]
    nxt["nvext"] = {"forced_script": script}
    return nxt


def chat_cached(resp: dict) -> tuple[int, int]:
    u = resp["usage"]
    return u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


APIS = {
    "anthropic": ("/v1/messages", anthropic_first, anthropic_next, anthropic_cached,
                  lambda body, secret: anthropic_conversation(body, secret)),
    "responses": ("/v1/responses", responses_first, responses_next, responses_cached,
                  lambda body, secret: responses_conversation(body, secret)),
    "chat": ("/v1/chat/completions", chat_first, chat_next, chat_cached, lambda body, secret: chat_conversation(body)),
}


CASES = [(model, api, turn) for model in PAIRS for api in APIS for turn in ("tool", "answer")]


def check_case(serve_url: str, renderers, model: str, api: str, turn: str) -> None:
    rends, secret = renderers
    renderer = rends[model]
    path, first, nxt, cached_of, convert = APIS[api]
    script = PAIRS[model][0 if turn == "tool" else 1]
    nonce = uuid.uuid4().hex[:12]

    body = first(model, nonce, script)
    resp = post(serve_url + path, body)
    conv, opts = convert(body, secret)
    prompt = renderer.render_sync(conv, opts)
    n_prompt, _ = cached_of(resp)
    assert len(prompt.token_ids) == n_prompt, "the local render is not the server's"

    body2 = nxt(body, resp, PAIRS[model][1])
    resp2 = post(serve_url + path, body2)
    conv2, opts2 = convert(body2, secret)
    prompt2 = renderer.render_sync(conv2, opts2)
    n_prompt2, cached2 = cached_of(resp2)
    assert len(prompt2.token_ids) == n_prompt2

    tok = renderer.tokenizer
    generated = tok.encode(script, add_special_tokens=False) + [tok.eos_token_id]  # what the forcing processor fed
    assert len(generated) > BLOCK
    result = check_turn(prompt.token_ids, generated, prompt2.token_ids)
    REPORT.append((model, api, turn, result.reused, len(result.cached), result.reused_fraction, cached2))
    assert result.stable, result.diverges_at(tok)
    # The engine's own prefix-cache hit on N+1 covers every full block of N's prompt + generation.
    # (The last generated token, end-of-turn, was sampled but never fed back, so its KV is not in the cache.)
    assert cached2 >= ((len(result.cached) - 1) // BLOCK) * BLOCK


@pytest.fixture(scope="module")
def outcomes(serve_url, renderers) -> dict:
    """Every case run at once: each is two forced ~150-token generations, and on two CPU cores one decode step
    costs about the same for one sequence as for twelve, so together they take the time of one."""
    def outcome(case):
        try:
            check_case(serve_url, renderers, *case)
        except Exception as e:  # noqa: BLE001 - re-raised by the case's own test
            return e
        return None

    with ThreadPoolExecutor(len(CASES)) as pool:
        return dict(zip(CASES, pool.map(outcome, CASES)))


@pytest.mark.parametrize("model, api, turn", CASES, ids=["-".join(c) for c in CASES])
def test_turn_n_plus_1_starts_with_turn_n(outcomes, model, api, turn):
    failure = outcomes[(model, api, turn)]
    if failure is not None:
        raise failure


def teardown_module(module):
    if REPORT:
        print("\nprefix reuse through the engine (model, api, turn: reused/cached ids, fraction, engine cached):")
        for model, api, turn, reused, total, frac, engine in REPORT:
            print(f"  {model:<24}{api:<10}{turn:<7}{reused:>5}/{total:<5} {frac:6.1%}  engine cached {engine}")
