"""Counting through the real server: Anthropic `count_tokens`, `/v1/tokenize`, and the prompt tokens the engine
reports (`usage` of Messages, Chat Completions and Responses) agree to the token on the same request, and the
per-session attribution line neither counts nor breaks prefix reuse."""

from __future__ import annotations

import uuid

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"


def billing(session: str) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.197.{session[:3]}; cc_entrypoint=cli;"


def system_text(nonce: str, sentences: int = 40) -> str:
    # A nonce up front: no cache left over from an earlier test run can help.
    return f"[{nonce}] You are a careful coding agent.\n" + "\n".join(
        f"Rule {i}: read every file you change and run the tests for module {i} before you answer." for i in range(sentences))


@pytest.fixture(scope="module")
def claude(serve_url):
    return anthropic.Anthropic(base_url=serve_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(serve_url):
    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_counts_agree_across_apis(serve_url, claude, oai):
    nonce = uuid.uuid4().hex[:8]
    system = system_text(nonce, 6)
    user = "Which rule covers module 3?"
    counted = claude.messages.count_tokens(
        model=MODEL, system=[{"type": "text", "text": billing(nonce)}, {"type": "text", "text": system}],
        messages=[{"role": "user", "content": user}]).input_tokens

    tok = httpx.post(f"{serve_url}/v1/tokenize", json={"model": MODEL, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]}, timeout=120)
    assert tok.status_code == 200, tok.text
    assert tok.json()["count"] == counted
    assert tok.json()["max_model_len"] == 8192

    msg = claude.messages.create(
        model=MODEL, max_tokens=2, system=[{"type": "text", "text": billing(nonce)}, {"type": "text", "text": system}],
        messages=[{"role": "user", "content": user}])
    u = msg.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0) == counted

    chat = oai.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": user}])
    assert chat.usage.prompt_tokens == counted

    resp = oai.responses.create(model=MODEL, instructions=system, input=user, max_output_tokens=16, store=False)
    assert resp.usage.input_tokens == counted


def test_count_with_tools_and_history_matches_the_engine(claude):
    tools = [{"name": "read_file", "description": "Read a file.",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
    messages = [
        {"role": "user", "content": "Open a.py"},
        {"role": "assistant", "content": [{"type": "text", "text": "Reading it."},
                                          {"type": "tool_use", "id": "toolu_01", "name": "read_file",
                                           "input": {"path": "a.py"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "print('hi')"},
                                     {"type": "text", "text": "What does it print?"}]},
    ]
    counted = claude.messages.count_tokens(model=MODEL, tools=tools, messages=messages).input_tokens
    u = claude.messages.create(model=MODEL, max_tokens=2, tools=tools, messages=messages).usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == counted


def test_per_session_billing_line_keeps_the_prefix_cached(claude):
    """Two sessions differing only in the attribution line: the second reuses the first's prefill. A per-session
    line the stripper does not know (same place, same length) is the control: it leaves nothing to reuse."""
    nonce = uuid.uuid4().hex[:8]
    system = system_text(nonce)
    user = [{"role": "user", "content": "Summarise the rules."}]

    def send(first_line: str):
        return claude.messages.create(model=MODEL, max_tokens=1, messages=user, system=[
            {"type": "text", "text": first_line}, {"type": "text", "text": system}]).usage

    first = send(billing("a11"))
    second = send(billing("b22"))
    total = first.input_tokens + (first.cache_read_input_tokens or 0)
    assert second.input_tokens + (second.cache_read_input_tokens or 0) == total
    assert total > 300  # more than two CPU KV blocks (128 tokens each) to reuse
    assert (second.cache_read_input_tokens or 0) >= total - 128  # all but the last partial block

    control_a = send("x-session-attribution: cc_version=2.1.197.c33; cc_entrypoint=cli;")
    control_b = send("x-session-attribution: cc_version=2.1.197.d44; cc_entrypoint=cli;")
    # The unknown line sits in the first block, so the chained block hashes of everything after it differ.
    assert (control_a.cache_read_input_tokens or 0) < 128
    assert (control_b.cache_read_input_tokens or 0) < 128
