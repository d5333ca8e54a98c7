"""Each token limit as each API's vendor reports it (the table in docs/limits.md), read back by the real SDKs.

The service's side (which limit stopped a generation) is tests/unit/test_service.py; here every encoder maps the
IR's finish reasons, streamed (the SDK's own stream accumulator over the bytes) and folded (the non-streaming
body), and the two agree. A prompt that alone does not fit is each API's 400 (the Anthropic and Responses routes'
own tests check theirs; the Chat route's is here).
"""

from __future__ import annotations

import typing
import uuid

import anthropic
import httpx
import httpx2  # the transport the anthropic SDK is built on
import openai
import pytest
from anthropic.types import StopReason
from openai.types.chat.chat_completion import Choice

from serve_app.conversation import Finish, TextDelta, Usage
from serve_app.errors import PromptTooLong
from serve_app.ingress.anthropic.encode import MessageEncoder
from serve_app.ingress.anthropic.encode import fold as anthropic_fold
from serve_app.ingress.anthropic.encode import to_frames
from serve_app.ingress.chat.encode import ChatStreamEncoder, completion_body
from serve_app.ingress.context import IngressContext
from serve_app.ingress.responses.encode import ResponsesEncoder
from serve_app.ingress.responses.encode import fold as responses_fold
from serve_app.ingress.server import create_app
from serve_app.settings import AppSettings

# The IR's finish reason → (Anthropic stop_reason, Chat finish_reason, Responses status, incomplete reason, status
# of the item the stop cut).
TABLE = {
    "stop": ("end_turn", "stop", "completed", None, "completed"),
    "length": ("max_tokens", "length", "incomplete", "max_output_tokens", "incomplete"),  # the client's max_tokens
    # the model's output cap in the service's config, where the client set no limit or a larger one: Anthropic
    # pauses the turn, Responses completes and says what cut the item
    "output_cap": ("pause_turn", "length", "completed", "max_output_tokens", "incomplete"),
    "context_window": ("model_context_window_exceeded", "length", "incomplete", "max_output_tokens", "incomplete"),
}
EVENTS = [Usage(50, 0, estimated=True), TextDelta("Hel"), TextDelta("lo"), Usage(50, 2)]


def mock(body: bytes, lib=httpx):
    return lib.Client(transport=lib.MockTransport(
        lambda request: lib.Response(200, content=body, headers={"content-type": "text/event-stream"})))


@pytest.mark.parametrize("reason", list(TABLE))
def test_anthropic_stop_reason(reason):
    events = [*EVENTS, Finish(reason)]
    enc = MessageEncoder("m", "msg_1", thinking=False, secret=b"k" * 32)
    stream = [e for ev in events for e in enc.event(ev)]
    sdk = anthropic.Anthropic(api_key="x", base_url="http://t", max_retries=0, http_client=mock(to_frames(stream), httpx2))
    with sdk.messages.stream(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]) as s:
        streamed = s.get_final_message()
    folded = anthropic_fold(stream)
    assert streamed.stop_reason == folded["stop_reason"] == TABLE[reason][0]
    assert folded["stop_reason"] in typing.get_args(StopReason)
    assert streamed.content[0].text == "Hello" and streamed.usage.output_tokens == 2


@pytest.mark.parametrize("reason", list(TABLE))
def test_chat_finish_reason(reason):
    events = [*EVENTS, Finish(reason)]
    enc = ChatStreamEncoder("m", "r1", include_usage=True)
    body = enc.start() + b"".join(f for ev in events for f in enc.event(ev))
    sdk = openai.OpenAI(api_key="x", base_url="http://t/v1", max_retries=0, http_client=mock(body))
    chunks = list(sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True))
    streamed = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    folded = completion_body("m", "r1", events)["choices"][0]
    assert streamed == [folded["finish_reason"]] == [TABLE[reason][1]]
    Choice.model_validate(folded)  # strictly: the value is in the SDK's finish_reason enum


@pytest.mark.parametrize("reason", list(TABLE))
def test_responses_status_and_incomplete_reason(reason):
    events = [*EVENTS, Finish(reason)]
    enc = ResponsesEncoder(response_id="resp_1", model="m", echo={}, created_at=1)
    body = b"".join(enc.start()) + b"".join(f for ev in events for f in enc.event(ev))
    sdk = openai.OpenAI(api_key="x", base_url="http://t/v1", max_retries=0, http_client=mock(body))
    last = list(sdk.responses.create(model="m", input="hi", stream=True))[-1]
    folded = responses_fold(ResponsesEncoder(response_id="resp_2", model="m", echo={}, created_at=1), events)
    _, _, status, why, item_status = TABLE[reason]
    assert last.type == f"response.{status}" and last.response.status == folded["status"] == status
    details = last.response.incomplete_details
    assert (details.reason if details else None) == (folded["incomplete_details"] or {}).get("reason") == why
    assert last.response.output[0].status == folded["output"][0]["status"] == item_status


class TooLong:
    """A service whose every prompt is longer than the context."""

    async def prepare(self, conv, opts, model_id, received=None, routed=None):
        raise PromptTooLong(9000, 8192)


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_prompt_too_long_is_openais_400(stream):
    app = create_app(IngressContext(settings=AppSettings.model_validate({"models": [{"id": "m1"}]}),
                                    service=TooLong(), secret=b"s"))
    sdk = openai.AsyncOpenAI(api_key="x", base_url="http://t/v1", max_retries=0,
                             http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.chat.completions.create(model="m1", messages=[{"role": "user", "content": uuid.uuid4().hex}],
                                          stream=stream)
    err = e.value
    assert err.status_code == 400 and err.code == "context_length_exceeded" and err.param == "messages"
    assert err.type == "invalid_request_error"
    assert err.body["message"] == ("This model's maximum context length is 8192 tokens. However, your messages "
                                   "resulted in 9000 tokens. Please reduce the length of the messages.")
