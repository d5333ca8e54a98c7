"""Server-sent-event framing and keep-alive, shared by every streaming API."""

from __future__ import annotations

import json
from collections import deque
from typing import Any, AsyncIterator, TypeVar

from serve_app.conversation import Finish
from serve_app.errors import Overloaded, ServiceError
from serve_app.streams import Pump

T = TypeVar("T")

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    # Tell reverse proxies (nginx) not to buffer: each frame must reach the client as produced.
    "X-Accel-Buffering": "no",
}


# One encoder for every frame: json.dumps with options of its own builds a new JSONEncoder on each call, and a frame
# per streamed token is the ingress's hottest path. The output is json.dumps's, byte for byte.
compact_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def frame(data: Any, event: str | None = None) -> bytes:
    """One SSE frame. `data` is JSON-encoded unless it is already a string."""
    payload = data if isinstance(data, str) else compact_json(data)
    if event is None:
        return f"data: {payload}\n\n".encode()
    return f"event: {event}\ndata: {payload}\n\n".encode()


DONE = b"data: [DONE]\n\n"


class KeepAlive:
    """Items from `source`, and `None` whenever `interval` seconds pass without one.

    The caller turns `None` into its protocol's keep-alive (Anthropic `ping`, an SSE comment), so a client
    waiting through a long queue or prefill sees bytes and does not time out. The source is read ahead
    (serve_app/streams.py): `ready()` hands over what is already read, so a driver that falls behind frames
    several events into one write. Closing this closes `source`, which propagates cancellation to the engine
    request.
    """

    def __init__(self, source: AsyncIterator[T], interval: float):
        self._pump: Pump[T] = Pump(source)
        self._interval = interval
        self._ready: deque[T] = deque()

    def __aiter__(self) -> "KeepAlive":
        return self

    async def __anext__(self) -> T | None:
        if self._ready:
            return self._ready.popleft()
        batch = await self._pump.next_batch(self._interval)
        if not batch:
            return None
        self._ready.extend(batch[1:])
        return batch[0]

    def ready(self) -> list[T]:
        """The items already read, without waiting."""
        out = list(self._ready)
        self._ready.clear()
        return out + self._pump.drain()

    async def aclose(self) -> None:
        await self._pump.aclose()


def with_keepalive(source: AsyncIterator[T], interval: float) -> KeepAlive:
    return KeepAlive(source, interval)


async def batches(stream) -> AsyncIterator[list]:
    """Lists of items: the next one (awaited), then every item already read behind it (`ready()`), so a
    consumer that keeps up gets one at a time and one that lags gets them together. `None` stays alone."""
    async for item in stream:
        if item is None:
            yield [None]
            continue
        ready = getattr(stream, "ready", None)
        yield [item, *ready()] if ready is not None else [item]


class _Empty:
    pass


EMPTY = _Empty()  # what `peek` returns as the first item of a stream that yielded nothing


def finish_error(ev: Finish) -> ServiceError:
    """The error a `Finish("error")` stands for, before any output (the HTTP answer) or after it (the stream's error
    object), so both carry the same type and code."""
    if ev.error_kind == "overloaded":
        # A full engine queue is worth retrying soon: the answer carries retry-after like the admission cap's.
        return Overloaded(ev.error or "the service is overloaded, retry shortly", retry_after=ev.retry_after or 1.0)
    return ServiceError(ev.error_kind or "api_error", ev.error or "engine error")


def refusal(first) -> ServiceError | None:
    """The error to answer with, when a peeked stream ended or failed before producing anything."""
    if first is EMPTY:
        return ServiceError("api_error", "the generation ended before it started")
    if isinstance(first, Finish) and first.reason == "error":
        return finish_error(first)
    return None


async def peek(stream: AsyncIterator[T]) -> tuple[T | _Empty, AsyncIterator[T]]:
    """Await the first item, and return it with an iterator that yields it again and then the rest.

    The driver (ingress/streaming.py) peeks before it commits a response head, so a refusal that comes before any
    output (an overloaded engine, a failed route) keeps its HTTP status, which clients retry more readily than an
    in-stream error.
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

    def ready(self) -> list:
        if self._pending:
            return []
        ready = getattr(self._stream, "ready", None)
        return ready() if ready is not None else []

    async def aclose(self) -> None:
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()
