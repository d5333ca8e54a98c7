"""Structured output through the real engine's grammar: Chat `response_format`, Responses `text.format` (what
`codex exec --output-schema` sends) and Anthropic `output_config.format`, each through its own SDK.

The schema allows a few exact answers only (enums, a bounded integer, a boolean), so a 135M model answering freely
would not produce it: the answer parses and fits only because the engine enforced the grammar.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

pytestmark = pytest.mark.integration

MODEL = "smollm2-135m-instruct"
PROMPT = "Give me a city and its country."
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Tokyo"]},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population_millions", "capital"],
    "additionalProperties": False,
}
BAD_SCHEMA = {"type": "objekt"}


def assert_fits(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"city", "population_millions", "capital"}, value
    assert value["city"] in ("Paris", "Rome", "Tokyo")
    assert isinstance(value["population_millions"], int) and 0 <= value["population_millions"] <= 99
    assert isinstance(value["capital"], bool)


@pytest.fixture(scope="module")
def oai(serve_url):
    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(serve_url):
    return anthropic.Anthropic(base_url=serve_url, api_key="unused", max_retries=0, timeout=300)


def test_chat_json_schema_streamed_and_not(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=120,
              response_format=fmt)
    whole = oai.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "stop"
    assert_fits(whole.choices[0].message.content)
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert_fits(streamed)


def test_responses_text_format(oai):
    r = oai.responses.create(model=MODEL, input=PROMPT, temperature=0, max_output_tokens=120, text={"format": {
        "type": "json_schema", "name": "codex_output_schema", "schema": SCHEMA, "strict": True}})
    assert r.status == "completed"
    assert_fits(r.output_text)
    assert r.text.format.type == "json_schema"


def test_anthropic_output_config_format(claude):
    m = claude.messages.create(model=MODEL, max_tokens=120, messages=[{"role": "user", "content": PROMPT}],
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
    assert m.stop_reason == "end_turn"
    assert_fits("".join(b.text for b in m.content if b.type == "text"))


def test_a_schema_the_grammar_cannot_compile_is_a_400_in_each_envelope(oai, claude):
    with pytest.raises(openai.BadRequestError) as chat_err:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
                                    response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}})
    assert "objekt" in chat_err.value.message
    with pytest.raises(anthropic.BadRequestError) as msg_err:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": PROMPT}], stream=True,
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": BAD_SCHEMA}}})
    assert msg_err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as kind_err:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
                                    response_format={"type": "xml"})
    assert kind_err.value.body["param"] == "response_format.type"
