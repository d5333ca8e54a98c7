"""Open-union discriminators (serve_app/protocols/tags.py): bad `type` values are a validation error, never a crash."""

import pytest
from pydantic import ValidationError

from serve_app.protocols.anthropic import MessagesRequest
from serve_app.protocols.responses import ResponsesRequest
from serve_app.protocols.tags import type_discriminator

tag = type_discriminator(("text", "tool_use"), "unknown", missing="text", aliases={"server_tool_use": "tool_use"})


@pytest.mark.parametrize("value, expected", [
    ({"type": "text"}, "text"),
    ({"type": "server_tool_use"}, "tool_use"),
    ({"type": "video"}, "unknown"),
    ({}, "text"),
    ({"type": ["text"]}, "unknown"),  # unhashable: must not raise TypeError
    ({"type": {"a": 1}}, "unknown"),
    ({"type": 3}, "unknown"),
    ("not a dict", "text"),
])
def test_tags(value, expected):
    assert tag(value) == expected


@pytest.mark.parametrize("bad", [["text"], {"x": 1}, 7, None])
def test_anthropic_block_with_a_bad_type_is_a_validation_error(bad):
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": bad, "text": "hi"}]}]})


@pytest.mark.parametrize("bad", [["message"], {"x": 1}, 7])
def test_responses_item_and_tool_with_a_bad_type_are_validation_errors(bad):
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"model": "m", "input": [{"type": bad, "role": "user", "content": "x"}]})
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"model": "m", "input": "x", "tools": [{"type": bad, "name": "f"}]})
