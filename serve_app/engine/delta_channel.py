"""Engine deltas from an engine replica to an ingress process: one ZMQ connection per pair, one frame per
engine step for all the requests they share. No Ray in it.

Why: a Serve streaming call costs a transport item per (request, engine step) — pickled by the replica, sent,
received and unpickled by the ingress — and at concurrency 32 that per-token cost was most of the engine
replica's CPU and a fifth of the ingress's (docs/serving-path.md). Here each request still has its Serve call,
but as a lease only: it carries the acceptance, Serve's admission, queueing, routing and autoscaling count,
cancellation on client disconnect, and the failure of a dead replica. The tokens travel beside it: every delta
the replica produces in one event-loop turn (one engine step) goes to an ingress as one msgpack frame, however
many of that ingress's requests it holds.

Ordering: one PUSH→PULL connection per (replica, ingress) keeps each request's deltas in order. The lease may end
before the last frame arrives (two channels); the ingress then waits `LOST_GRACE_S` for the finishing delta
before reporting the stream as broken. Frames are msgpack rows of plain values, never pickles: the ingress's port
accepts connections from inside the cluster, like Ray's own ports.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from serve_app.engine.types import EngineChunk

log = logging.getLogger(__name__)

# After the lease ends, how long the finishing delta may still take to arrive before the stream counts as broken.
LOST_GRACE_S = 10.0
# A replica's socket to an ingress with no request in flight is closed after this long (ingress replicas come and
# go with autoscaling; their addresses must not pile up).
IDLE_CLOSE_S = 60.0

_ENCODE = msgspec.msgpack.Encoder()
_DECODE = msgspec.msgpack.Decoder(list)


def _row(key: int, c: EngineChunk) -> list[Any]:
    return [key, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.num_cached_tokens, c.error, c.engine_ms]


def encode(rows: list[list[Any]]) -> bytes:
    return _ENCODE.encode(rows)


def decode(frame: bytes) -> list[tuple[int, EngineChunk]]:
    out = []
    for key, text, token_ids, finish, stop, cached, error, engine_ms in _DECODE.decode(frame):
        out.append((key, EngineChunk(text, token_ids, finish, stop, cached, error, engine_ms)))
    return out


class DeltaSender:
    """The engine replica's side. `send` queues a delta; everything queued in one event-loop turn leaves as one
    frame per destination at the end of the turn. Runs on one event loop (ZMQ sockets are not thread-safe)."""

    def __init__(self, context: zmq.Context | None = None):
        self._ctx = context or zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}
        self._users: dict[str, int] = {}
        self._pending: dict[str, list[list[Any]]] = {}
        self._scheduled = False
        self.frames_sent = 0

    def acquire(self, address: str) -> None:
        self._users[address] = self._users.get(address, 0) + 1

    def release(self, address: str) -> None:
        self._users[address] -= 1
        if self._users[address] == 0:
            asyncio.get_running_loop().call_later(IDLE_CLOSE_S, self._close_if_idle, address)

    def send(self, address: str, key: int, chunk: EngineChunk) -> None:
        self._pending.setdefault(address, []).append(_row(key, chunk))
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, {}
        for address, rows in pending.items():
            # Never blocks: with no high-water mark ZMQ queues in its own I/O thread (an ingress that died has its
            # leases cancelled, so what queues for it is bounded by the requests in flight).
            self._socket(address).send(encode(rows), zmq.NOBLOCK)
            self.frames_sent += 1

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._sockets[address] = sock
        return sock

    def _close_if_idle(self, address: str) -> None:
        if self._users.get(address) == 0 and address not in self._pending:
            del self._users[address]
            sock = self._sockets.pop(address, None)
            if sock is not None:
                sock.close()

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()


class Inbox:
    """One request's deltas on the ingress side: what arrived since the last read, then the end or an error."""

    def __init__(self):
        self._items: list[EngineChunk] = []
        self._error: BaseException | None = None
        self._wake = asyncio.Event()
        self._finished = False
        self._lost_timer: asyncio.TimerHandle | None = None

    def put(self, chunk: EngineChunk) -> None:
        self._items.append(chunk)
        if chunk.finish_reason is not None:
            self._finished = True
            self.close()  # the end arrived: nothing is lost
        self._wake.set()

    def fail(self, error: BaseException) -> None:
        """The lease failed (replica died, request refused mid-way): the error comes after what already arrived."""
        if self._error is None:
            self._error = error
            self._wake.set()

    def lease_ended(self) -> None:
        """The replica finished the request; its last delta may still be on the way."""
        if not self._finished and self._lost_timer is None:
            self._lost_timer = asyncio.get_running_loop().call_later(
                LOST_GRACE_S, self.fail, ConnectionError("the engine finished but its last deltas never arrived"))

    async def next(self) -> list[EngineChunk]:
        """Everything that arrived since the last call (at least one chunk); raises the failure after them."""
        while not self._items:
            if self._error is not None:
                raise self._error
            self._wake.clear()
            await self._wake.wait()
        items, self._items = self._items, []
        return items

    def close(self) -> None:
        if self._lost_timer is not None:
            self._lost_timer.cancel()


class DeltaReceiver:
    """The ingress's side: one PULL socket bound on this node, read by one task that hands each delta to the
    inbox of its request. Create it on the event loop that reads the inboxes."""

    def __init__(self, host: str, context: zmq.asyncio.Context | None = None):
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._inboxes: dict[int, Inbox] = {}
        self._keys = itertools.count(1)
        self.frames_received = 0
        self._task = asyncio.get_running_loop().create_task(self._run())

    def register(self) -> tuple[int, Inbox]:
        key = next(self._keys)
        inbox = self._inboxes[key] = Inbox()
        return key, inbox

    def unregister(self, key: int) -> None:
        inbox = self._inboxes.pop(key, None)
        if inbox is not None:
            inbox.close()

    async def _run(self) -> None:
        while True:
            try:
                frame = await self._sock.recv()
                self.frames_received += 1
                for key, chunk in decode(frame):
                    inbox = self._inboxes.get(key)
                    if inbox is not None:  # else the request was closed already (client went away)
                        inbox.put(chunk)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                if self._sock.closed:
                    return
                log.exception("delta receiver: socket error")
            except Exception:  # noqa: BLE001 - a malformed frame must not stop every other request's deltas
                log.exception("delta receiver: dropped a malformed frame")

    async def aclose(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._sock.close()
        for inbox in self._inboxes.values():
            inbox.close()
        self._inboxes.clear()
