"""A stand-in GenerationService for unit tests of the Anthropic routes (no Ray, no engine): it replays synthetic
event lists chosen by `nvext.forced_script`, so the real anthropic SDK can parse the bytes the routes produce.
Integration tests use the real service and engine."""

from __future__ import annotations

import asyncio
import uuid

from serve_app.conversation import (
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from serve_app.errors import Overloaded, PromptTooLong, ServiceError
from serve_app.ingress.context import IngressContext
from serve_app.service import PreparedRequest
from serve_app.settings import AppSettings

SECRET = b"unit-test-secret"
CACHED = 3


def prompt_len(conv) -> int:
    """A deterministic stand-in for tokenization: one token per 4 characters of every part, plus tools."""
    n = 10
    for m in conv.messages:
        for p in m.parts:
            n += len(repr(p)) // 4
    n += sum(len(repr(t)) // 4 for t in conv.tools)
    return n


def script(name: str, n_prompt: int) -> list:
    u0 = Usage(n_prompt, 0, cached_tokens=CACHED, estimated=True)

    def end(reason="stop", completion=7, **kw):
        return [Usage(n_prompt, completion, cached_tokens=CACHED), Finish(reason, **kw)]

    if name == "text":
        return [u0, TextDelta("Hel"), TextDelta("lo"), *end()]
    if name == "think_text_tool":
        return [
            u0,
            ReasoningDelta("Let me "),
            ReasoningDelta("look."),
            TextDelta("\n\n"),
            TextDelta("I'll list."),
            ToolCallStart(0, "call_abc123", "Bash"),
            ToolCallArgsDelta(0, '{"command": '),
            ToolCallArgsDelta(0, '"ls"}'),
            ToolCallEnd(0),
            *end("tool_calls"),
        ]
    if name == "interleaved":
        return [
            u0,
            ReasoningDelta("first"),
            ToolCallStart(0, "call_1", "Read"),
            ToolCallArgsDelta(0, '{"path": "a"}'),
            ToolCallEnd(0),
            ReasoningDelta("second"),
            ToolCallStart(1, "call_2", "Read"),
            ToolCallArgsDelta(1, '{"path": "b"}'),
            ToolCallEnd(1),
            *end("tool_calls"),
        ]
    if name == "stop_seq":
        return [u0, TextDelta("one two"), *end("stop_sequence", stop_sequence="THREE")]
    if name == "length":
        return [u0, TextDelta("truncated"), *end("length")]
    if name == "midstream_error":
        return [u0, TextDelta("partial"), Finish("error", error="replica died", error_kind="overloaded")]
    if name == "routing_overload":
        return [Finish("error", error="no replica can take it", error_kind="overloaded")]
    if name == "slow":
        return [u0, "sleep", TextDelta("late"), *end()]
    raise KeyError(name)


class FakeService:
    def __init__(self, settings: AppSettings):
        self.settings = settings
        self.closed = 0

    def resolve_model(self, model_id):
        from serve_app.errors import ModelNotFound

        m = self.settings.find_model(model_id)
        if m is None:
            raise ModelNotFound(model_id)
        return m

    async def count_tokens(self, conv, opts, model_id):
        self.resolve_model(model_id)
        return prompt_len(conv)

    async def prepare(self, conv, opts, model_id):
        model = self.resolve_model(model_id)
        fs = opts.forced_script or "text"
        if fs.startswith("raise:"):
            kind = fs.split(":", 1)[1]
            if kind == "overloaded":
                raise Overloaded(retry_after=2.5)
            if kind == "too_long":
                raise PromptTooLong(300000, 200000)
            raise ServiceError(kind, f"forced {kind}", retry_after=1.0 if kind == "rate_limit" else None)
        return PreparedRequest(
            request_id=uuid.uuid4().hex,
            model_id=model_id,
            model=model,
            conversation=conv,
            options=opts,
            prompt_token_ids=list(range(prompt_len(conv))),
            max_tokens=min(opts.max_tokens or 16, model.max_output_tokens),
        )

    async def stream(self, prepared):
        try:
            for ev in script(prepared.options.forced_script or "text", prepared.num_prompt_tokens):
                if ev == "sleep":
                    await asyncio.sleep(0.3)
                    continue
                yield ev
        finally:
            self.closed += 1

    async def complete(self, prepared):
        return [ev async for ev in self.stream(prepared)]


def make_settings(api_keys=(), ping=10.0) -> AppSettings:
    return AppSettings.model_validate(
        {
            "models": [
                {
                    "id": "test-model",
                    "aliases": ["claude-test"],
                    "display_name": "Test Model",
                    "max_model_len": 8192,
                    "max_output_tokens": 1024,
                }
            ],
            "ingress": {"api_keys": list(api_keys), "ping_interval_s": ping, "max_body_bytes": 200_000},
        }
    )


def make_app(api_keys=(), ping=10.0):
    from fastapi import FastAPI

    from serve_app.ingress.anthropic import routes

    settings = make_settings(api_keys, ping)
    service = FakeService(settings)
    app = FastAPI()
    app.state.ctx = IngressContext(settings=settings, service=service, secret=SECRET)
    app.include_router(routes.router)
    return app, service
