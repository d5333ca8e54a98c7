"""Server-sent-event framing and keep-alive, shared by every streaming API."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, TypeVar

from serve_app.conversation import Finish
from serve_app.errors import Overloaded, ServiceError

T = TypeVar("T")

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    # Tell reverse proxies (nginx) not to buffer: each frame must reach the client as produced.
    "X-Accel-Buffering": "no",
}


def frame(data: Any, event: str | None = None) -> bytes:
    """One SSE frame. `data` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    if event is None:
        return f"data: {payload}\n\n".encode()
    return f"event: {event}\ndata: {payload}\n\n".encode()


DONE = b"data: [DONE]\n\n"


async def with_keepalive(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | None]:
    """Yield items from `source`, and `None` whenever `interval` seconds pass without one.

    The caller turns `None` into its protocol's keep-alive (Anthropic `ping`, an SSE comment), so a client
    waiting through a long queue or prefill sees bytes and does not time out. Closing this generator
    closes `source`, which propagates cancellation to the engine request.
    """
    it = source.__aiter__()
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield None
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, StopAsyncIteration, Exception):
                pass
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


class _Empty:
    pass


EMPTY = _Empty()  # what `peek` returns as the first item of a stream that yielded nothing


def refusal(first) -> ServiceError | None:
    """The error to answer with, when a peeked stream ended or failed before producing anything."""
    if first is EMPTY:
        return ServiceError("api_error", "the generation ended before it started")
    if isinstance(first, Finish) and first.reason == "error":
        if first.error_kind == "overloaded":
            # A full engine queue is worth retrying soon: the answer carries retry-after like the admission cap's.
            return Overloaded(first.error or "the service is overloaded, retry shortly")
        return ServiceError(first.error_kind or "api_error", first.error or "engine error")
    return None


async def peek(stream: AsyncIterator[T]) -> tuple[T | _Empty, AsyncIterator[T]]:
    """Await the first item, and return it with an iterator that yields it again and then the rest.

    A route peeks before it commits a response head, so a refusal that comes before any output (an overloaded
    engine, a failed route) keeps its HTTP status, which clients retry more readily than an in-stream error.
    """
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        return EMPTY, stream
    return first, _Replayed(first, stream)


class _Replayed:
    """`first`, then the rest of `stream`; closing it closes `stream` even if it was never iterated."""

    def __init__(self, first, stream):
        self._first, self._stream, self._pending = first, stream, True

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._pending:
            self._pending = False
            return self._first
        return await self._stream.__anext__()

    async def aclose(self) -> None:
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()
