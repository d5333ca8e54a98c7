"""Structured-output requests of the three APIs read into one OutputFormat, and reach the engine as a grammar."""

from __future__ import annotations

import pytest

from serve_app.conversation import OutputFormat
from serve_app.errors import InvalidRequest
from serve_app.ingress import output_format
from serve_app.ingress.anthropic.convert import messages_request, to_conversation
from serve_app.ingress.chat.convert import chat_request_to_conversation as chat_to_conversation
from serve_app.service import _classify_engine_error, _engine_constraint

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def test_chat_response_format():
    assert output_format.from_chat(None) is None
    assert output_format.from_chat({"type": "text"}) is None
    assert output_format.from_chat({"type": "json_object"}) == OutputFormat()
    got = output_format.from_chat({"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}})
    assert got == OutputFormat(SCHEMA, "r", True)


def test_json_schema_without_a_schema_is_any_json():
    assert output_format.from_responses({"type": "json_schema", "name": "x"}) == OutputFormat(None, "x", False)


def test_responses_text_format():
    assert output_format.from_responses({"type": "text"}) is None
    got = output_format.from_responses({"type": "json_schema", "name": "codex_output_schema", "schema": SCHEMA, "strict": True})
    assert got == OutputFormat(SCHEMA, "codex_output_schema", True)


def test_anthropic_output_config_format():
    assert output_format.from_anthropic({"type": "json_schema", "schema": SCHEMA}, "output_config.format") == OutputFormat(SCHEMA)


@pytest.mark.parametrize("call,raw,param", [
    (output_format.from_chat, {"type": "xml"}, "response_format.type"),
    (output_format.from_chat, "json", "response_format.type"),
    (output_format.from_chat, {"type": "json_schema"}, "response_format.json_schema"),
    (output_format.from_chat, {"type": "json_schema", "json_schema": {"schema": []}}, "response_format.json_schema.schema"),
    (output_format.from_responses, {"type": "json_schema", "name": "x", "schema": "{}"}, "text.format.schema"),
    (lambda raw: output_format.from_anthropic(raw, "output_config.format"), {"type": "json_object"}, "output_config.format.type"),
])
def test_malformed_formats_name_the_field(call, raw, param):
    with pytest.raises(InvalidRequest) as e:
        call(raw)
    assert e.value.param == param and e.value.status == 400


def test_formats_reach_the_generation_options():
    req = messages_request({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                            "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": SCHEMA}}})
    _, opts = to_conversation(req, b"k" * 32)
    assert opts.output_format == OutputFormat(SCHEMA)
    beta = messages_request({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                             "output_format": {"type": "json_schema", "schema": SCHEMA}})
    assert to_conversation(beta, b"k" * 32)[1].output_format == OutputFormat(SCHEMA)
    _, _, chat_opts = chat_to_conversation({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                            "response_format": {"type": "json_object"}})
    assert chat_opts.output_format == OutputFormat()


def test_engine_constraint():
    assert _engine_constraint(None) is None
    assert _engine_constraint(OutputFormat()) == {"json_object": True}
    assert _engine_constraint(OutputFormat(SCHEMA)) == {"json": SCHEMA}


def test_vllm_validation_errors_are_the_clients():
    class VLLMClientError(Exception):
        pass

    class VLLMValidationError(VLLMClientError):
        pass

    class RayTaskError(Exception):  # how Ray hands a remote exception over: the original is its `cause`
        def __init__(self, cause):
            super().__init__(f"remote traceback...\n{cause}")
            self.cause = cause

    assert _classify_engine_error(RayTaskError(VLLMValidationError("Grammar error: Invalid type: objekt"))) == (
        "invalid_request", "Grammar error: Invalid type: objekt")
    assert _classify_engine_error(RuntimeError("boom"))[0] == "api_error"
