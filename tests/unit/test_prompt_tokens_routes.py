"""/v1/tokenize and /v1/detokenize over ASGI with the real GenerationService renderer and the default model's
tokenizer (no Ray, no engine: tokenizing needs neither). The oracle is transformers itself: the chat form must
give exactly `apply_chat_template` + `encode` of the same messages, so a count equals the engine's prompt."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from serve_app.ingress.context import IngressContext
from serve_app.ingress.server import create_app
from serve_app.service import GenerationService
from serve_app.settings import AppSettings

BILLING = "x-anthropic-billing-header: cc_version=2.1.197.a3f; cc_entrypoint=cli;"


@pytest.fixture(scope="module")
def model_dir() -> str:
    from serve_app.engine.provision import ensure_model

    return ensure_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    with open("serve_app/templates/smollm2_tools.jinja") as f:
        tok.chat_template = f.read()
    return tok


@pytest.fixture(scope="module")
def settings() -> AppSettings:
    return AppSettings.model_validate({"models": [
        {"id": "smollm2-135m-instruct", "max_model_len": 8192, "max_output_tokens": 1024,
         "tool_parser": "hermes", "chat_template": "serve_app/templates/smollm2_tools.jinja"},
        {"id": "strict", "source": "smollm2-135m-instruct", "chat_template":
            "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role here') }}"
            "{% endif %}{{ m['content'] }}{% endfor %}"},
    ]})


@pytest.fixture(scope="module")
def client(settings, model_dir):
    service = GenerationService(settings, engines=None, model_paths={"smollm2-135m-instruct": model_dir})
    app = create_app(IngressContext(settings=settings, service=service, secret=b"unit-test-secret"))

    def post(path: str, body: dict) -> httpx.Response:
        async def go() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return await c.post(path, json=body)

        return asyncio.run(go())

    return post


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": '{"path":  "."}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
]
TOOLS = [{"type": "function", "function": {"name": "ls", "description": "List files.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}}}}]


def test_completion_form_matches_the_tokenizer(client, hf_tokenizer):
    prompt = "def add(a, b):\n    return a + b  # émoji 🚀"
    r = client("/v1/tokenize", {"model": "smollm2-135m-instruct", "prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == hf_tokenizer.encode(prompt, add_special_tokens=True)
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 8192
    assert body["token_strs"] == hf_tokenizer.convert_ids_to_tokens(body["tokens"])
    plain = client("/tokenize", {"model": "smollm2-135m-instruct", "prompt": prompt}).json()  # the bare path
    assert plain["tokens"] == body["tokens"] and "token_strs" not in plain


def test_chat_form_is_exactly_the_template_render(client, hf_tokenizer):
    r = client("/v1/tokenize", {"model": "smollm2-135m-instruct", "messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 200, r.text
    text = hf_tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == hf_tokenizer.encode(text, add_special_tokens=False)
    # The tool call's arguments went through byte for byte (two spaces kept): prefix reuse depends on it.
    assert '"arguments": {"path":  "."}' in hf_tokenizer.decode(r.json()["tokens"])


def test_chat_form_without_generation_prompt_and_continuation(client, hf_tokenizer):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    r = client("/tokenize", {"model": "smollm2-135m-instruct", "messages": msgs, "add_generation_prompt": False,
                             "continue_final_message": True})
    assert r.status_code == 200, r.text
    text = hf_tokenizer.decode(r.json()["tokens"])
    assert text.endswith("<|im_start|>assistant\nHel"), text
    both = client("/tokenize", {"model": "smollm2-135m-instruct", "messages": msgs, "add_generation_prompt": True,
                                "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["type"] == "invalid_request_error"


def test_billing_line_is_not_counted(client):
    plain = client("/v1/tokenize", {"model": "smollm2-135m-instruct", "messages": MESSAGES})
    with_line = [{"role": "system", "content": BILLING + "\n" + MESSAGES[0]["content"]}, *MESSAGES[1:]]
    stripped = client("/v1/tokenize", {"model": "smollm2-135m-instruct", "messages": with_line})
    assert stripped.json()["tokens"] == plain.json()["tokens"]


def test_anthropic_count_tokens_agrees_with_tokenize(client):
    body = {"model": "smollm2-135m-instruct", "system": [{"type": "text", "text": BILLING},
                                                          {"type": "text", "text": "You are terse."}],
            "messages": [{"role": "user", "content": "List the files."}]}
    counted = client("/v1/messages/count_tokens", body)
    assert counted.status_code == 200, counted.text
    tok = client("/v1/tokenize", {"model": "smollm2-135m-instruct", "messages": [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "List the files."}]})
    assert counted.json()["input_tokens"] == tok.json()["count"]


def test_detokenize_round_trip(client):
    prompt = "Grüße, world!\n\tTabs and 🚀"
    ids = client("/v1/tokenize", {"model": "smollm2-135m-instruct", "prompt": prompt,
                                  "add_special_tokens": False}).json()["tokens"]
    r = client("/v1/detokenize", {"model": "smollm2-135m-instruct", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": prompt}
    assert client("/detokenize", {"tokens": ids}).json() == {"prompt": prompt}  # model is optional, as in vLLM


@pytest.mark.parametrize("path,body,status,needle", [
    ("/v1/detokenize", {"model": "smollm2-135m-instruct", "tokens": [1, -5]}, 400, "tokens"),
    ("/v1/detokenize", {"model": "smollm2-135m-instruct", "tokens": [10 ** 9]}, 400, "not a token id"),
    ("/v1/detokenize", {"model": "smollm2-135m-instruct", "tokens": "12"}, 400, "list of integers"),
    ("/v1/tokenize", {"model": "smollm2-135m-instruct"}, 400, "prompt"),
    ("/v1/tokenize", {"model": "smollm2-135m-instruct", "prompt": 5}, 400, "prompt"),
    ("/v1/tokenize", {"model": "nope", "prompt": "x"}, 404, "nope"),
    ("/v1/tokenize", {"model": ["smollm2-135m-instruct"], "prompt": "x"}, 400, "model: must be a string"),
    ("/v1/detokenize", {"model": 7, "tokens": [1]}, 400, "model: must be a string"),
    ("/v1/tokenize", {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, 400, "image"),
    ("/v1/tokenize", {"model": "strict", "messages": [{"role": "system", "content": "s"},
                                                      {"role": "user", "content": "u"}]}, 400, "no system role here"),
])
def test_errors_are_openai_envelopes(client, path, body, status, needle):
    r = client(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
