"""The one generation driver of the edge, every API's counterpart of `service.GenerationService`.

Each API supplies an `ApiAdapter` (ingress/<api>/api.py): how to parse its request into a `Call` (wire request,
Conversation, GenerationOptions), its `WireEncoder`, and a few choices; `generate` does the rest, the same for all:

    read body (auth, caps) → parse → prepare → complete and fold                          (non-streaming)
                                            → peek the first event: a refusal keeps its HTTP status
                                            → start, events as produced (batched only when lagging),
                                              keep-alives, and a failure in-protocol if the stream ends early

Errors raised here reach the route's envelope (ingress/envelope.py). Adding an API is one folder with its
`convert.py`, `encode.py` and `api.py`, and its router in `server.ROUTERS` (docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from serve_app import request_log
from serve_app.conversation import Conversation, Event, GenerationOptions
from serve_app.errors import ServiceError
from serve_app.ingress import sse
from serve_app.ingress.auth import check_api_key
from serve_app.ingress.body import read_json
from serve_app.ingress.context import IngressContext, replica_headers
from serve_app.routing.types import ROUTE_ID_HEADER

UNFINISHED = "the generation ended without finishing"
CLIENT_GONE = 499  # the status nginx and Ray Serve record for a request whose client left before its answer
T = TypeVar("T")


@dataclass
class Call:
    """One parsed request: what the service needs, and the API's own wire request for its encoder."""

    wire: Any
    model: str
    conversation: Conversation
    options: GenerationOptions
    stream: bool


class WireEncoder(Protocol):
    """One request's events in one API's wire format."""

    finished: bool  # the terminal event (end of message, completed/failed response, [DONE]) has been encoded

    def start(self) -> bytes:
        """What leaves as soon as the stream is committed (may be empty)."""

    def events(self, batch: list[Event]) -> bytes:
        """The frames of events produced together; nothing after the terminal one."""

    def keepalive(self) -> bytes:
        """A frame that keeps an idle client from timing out."""

    def fail(self, err: ServiceError) -> bytes:
        """End the stream with `err` in-protocol (a failure outside the event stream, or a stream cut short)."""

    def fold(self, events: list[Event]) -> dict[str, Any]:
        """The non-streaming answer: these events run through the same encoder and folded. Raises the
        ServiceError of a failed generation."""


class ApiAdapter(Protocol):
    # A refusal before any output (overloaded engine, failed route) answers with its HTTP status, which clients
    # retry more readily than an in-stream error. False: the first frame leaves before the engine is reached.
    peek_refusals: bool

    async def parse(self, body: Any, request: Request, ctx: IngressContext) -> Call: ...

    def encoder(self, call: Call, request_id: str, prompt_tokens: int, ctx: IngressContext) -> WireEncoder: ...

    def fails_in_stream(self, call: Call, err: ServiceError) -> bool:
        """Whether a streaming request whose preparation failed gets `err` in-stream instead of as HTTP."""

    async def finished(self, call: Call, encoder: WireEncoder, ctx: IngressContext) -> None:
        """Runs once the answer is complete, before its terminal frame leaves (the Responses store)."""

    def headers(self, request: Request, ctx: IngressContext) -> dict[str, str]: ...


class AdapterDefaults:
    """What most APIs want; an adapter subclasses this and overrides the rest of ApiAdapter."""

    peek_refusals = True

    def fails_in_stream(self, call: Call, err: ServiceError) -> bool:
        return False

    async def finished(self, call: Call, encoder: WireEncoder, ctx: IngressContext) -> None:
        return None

    def headers(self, request: Request, ctx: IngressContext) -> dict[str, str]:
        return {}


def until_finished(encode: Callable[[Event], list[T]], batch: list[Event], finished: Callable[[], bool]) -> list[T]:
    """`encode` over the events of a batch, stopping at the one that finishes the answer (nothing follows it)."""
    out: list[T] = []
    for ev in batch:
        out += encode(ev)
        if finished():
            break
    return out


async def read_body(request: Request, ctx: IngressContext) -> Any:
    ing = ctx.settings.ingress
    check_api_key(request.headers, ing.api_keys)
    return await read_json(request, ing.max_body_bytes, ing.max_decompressed_bytes)


async def generate(api: ApiAdapter, request: Request, ctx: IngressContext) -> Response:
    routed = time.monotonic()
    arrived = request_log.ARRIVED.get()
    call = await api.parse(await read_body(request, ctx), request, ctx)
    if ctx.settings.router.front_door:  # the front door's Router placed it: its load is kept under this id
        call.options.route_id = request.headers.get(ROUTE_ID_HEADER) or None  # empty: nothing reserved
    headers = {**replica_headers(ctx), **api.headers(request, ctx)}
    try:
        prepared = await ctx.service.prepare(call.conversation, call.options, call.model,
                                             received=arrived or routed, routed=routed if arrived else None)
    except ServiceError as err:
        if not (call.stream and api.fails_in_stream(call, err)):
            raise
        encoder = api.encoder(call, uuid.uuid4().hex, 0, ctx)
        return _sse(_failed(encoder, err), headers)
    encoder = api.encoder(call, prepared.request_id, prepared.num_prompt_tokens, ctx)

    if not call.stream:
        events = await unless_disconnected(request, ctx.service.complete(prepared))
        if events is None:
            return Response(status_code=CLIENT_GONE)  # nobody reads it; the request metrics count it
        if api.peek_refusals:  # the same answer as a stream refused before its first event: status, retry-after
            refused = sse.refusal(events[0] if events else sse.EMPTY)
            if refused is not None:
                raise refused
        body = encoder.fold(events)
        await api.finished(call, encoder, ctx)
        return JSONResponse(body, headers=headers)

    stream = sse.with_keepalive(ctx.service.stream(prepared), ctx.settings.ingress.ping_interval_s)
    if api.peek_refusals:
        first, stream = await sse.peek(stream)
        refused = sse.refusal(first)
        if refused is not None:
            await stream.aclose()
            raise refused
    return _sse(_frames(api, call, encoder, stream, ctx, prepared.marks), headers)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client left first: then `work` is cancelled, which closes its event stream
    and so aborts the engine request. The answers that are not streamed need this: a stream is watched by
    Starlette's StreamingResponse, and Serve's own watcher is off (`ingress.disconnects: app`, serve_tuning.py)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this request is cancelled itself
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its stream closed, the engine request aborted
    return None if task.cancelled() else task.result()


async def until_disconnected(request: Request) -> None:
    """Returns when the client has gone. Called once the body is read, when receive() only reports the end."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(frames: AsyncIterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(frames, media_type="text/event-stream", headers={**sse.SSE_HEADERS, **headers})


async def _failed(encoder: WireEncoder, err: ServiceError) -> AsyncIterator[bytes]:
    yield encoder.start() + encoder.fail(err)


async def _frames(api: ApiAdapter, call: Call, encoder: WireEncoder, stream, ctx: IngressContext,
                  marks: dict[str, float] | None = None):
    frame_mark = marks is not None  # the first token's frame is still to be marked
    try:
        head = encoder.start()
        if head:  # its own write: nothing waits behind the first token
            yield head
        # Each event leaves as produced; events that piled up while the route lagged leave in one write.
        async for batch in sse.batches(stream):
            out = encoder.keepalive() if batch == [None] else encoder.events(batch)
            if encoder.finished:
                await api.finished(call, encoder, ctx)  # e.g. stored before the terminal event leaves
            if out:
                yield out
                if frame_mark and "first_token" in marks:
                    marks["first_frame"] = time.monotonic()  # the server took the first token's frame
                    frame_mark = False
            if encoder.finished:
                break
        if not encoder.finished:  # the service always ends with Finish; never leave a client hanging if not
            yield encoder.fail(ServiceError("api_error", UNFINISHED))
    finally:
        await stream.aclose()
