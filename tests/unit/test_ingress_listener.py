"""The ingress replica's own listener (ingress/listener.py), without Ray: a shared port, and a drain that lets open
requests finish while a successor takes the new connections."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from serve_app.ingress.listener import Listener, reuseport_socket
from serve_app.settings import AppSettings


def app(name: str, release: asyncio.Event | None = None) -> Starlette:
    async def hello(request):
        return PlainTextResponse(name)

    async def slow(request):
        async def body():
            yield b"first;"
            await release.wait()
            yield b"last"
        return StreamingResponse(body())

    return Starlette(routes=[Route("/hello", hello), Route("/slow", slow)])


@contextlib.asynccontextmanager
async def slow_stream(port: int):
    """A /slow response whose first chunk has arrived; yields the rest of its body."""
    async with httpx.AsyncClient(timeout=10) as client, client.stream("GET", f"http://127.0.0.1:{port}/slow") as resp:
        chunks = resp.aiter_raw()
        assert await anext(chunks) == b"first;"
        yield chunks


async def started(listener: Listener) -> Listener:
    listener.start()
    for _ in range(200):
        if listener.server.started:
            return listener
        await asyncio.sleep(0.01)
    raise AssertionError("the listener did not start")


async def test_two_listeners_share_one_port_and_both_serve():
    a = await started(Listener(app("a"), "127.0.0.1", 0, keep_alive_s=5, drain_s=1))
    b = await started(Listener(app("b"), "127.0.0.1", a.port, keep_alive_s=5, drain_s=1))
    seen = set()
    try:
        for _ in range(64):  # a new connection each time: the kernel picks a listener per connection
            async with httpx.AsyncClient() as client:
                seen.add((await client.get(f"http://127.0.0.1:{a.port}/hello")).text)
            if seen == {"a", "b"}:
                break
    finally:
        await a.drain()
        await b.drain()
    assert seen == {"a", "b"}


def test_the_listener_leaves_the_processs_signals_to_its_owner():
    """In the main thread (the single-process server) uvicorn would take SIGINT/SIGTERM over while it serves and
    re-raise them when it stops; the process's owner (Ray, single_process.py) keeps them."""
    import signal

    def owner(*_):
        pass

    async def serve_once() -> tuple:
        listener = await started(Listener(app("a"), "127.0.0.1", 0, keep_alive_s=5, drain_s=1))
        during = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        await listener.drain()
        return during

    before = signal.signal(signal.SIGINT, owner), signal.signal(signal.SIGTERM, owner)
    try:
        assert asyncio.run(serve_once()) == (owner, owner)
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == (owner, owner)
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])


async def test_a_drain_finishes_open_requests_while_the_successor_takes_new_ones():
    release = asyncio.Event()
    old = await started(Listener(app("old", release), "127.0.0.1", 0, keep_alive_s=5, drain_s=30))
    async with slow_stream(old.port) as chunks:
        new = await started(Listener(app("new"), "127.0.0.1", old.port, keep_alive_s=5, drain_s=1))
        drain = asyncio.create_task(old.drain())
        await asyncio.sleep(0.3)  # the old listener has closed its socket: only the new one accepts
        assert not drain.done()  # its open stream holds the drain
        for _ in range(8):
            async with httpx.AsyncClient() as fresh:
                assert (await fresh.get(f"http://127.0.0.1:{old.port}/hello")).text == "new"
        release.set()
        assert b"".join([c async for c in chunks]) == b"last"
    await asyncio.wait_for(drain, 5)
    await new.drain()


async def test_a_drain_past_its_time_cancels_what_is_left():
    never = asyncio.Event()
    listener = await started(Listener(app("x", never), "127.0.0.1", 0, keep_alive_s=5, drain_s=0.5))
    async with slow_stream(listener.port) as chunks:
        await asyncio.wait_for(listener.drain(), 5)
        with pytest.raises(httpx.HTTPError):  # cut off, not completed: the client can tell
            async for _ in chunks:
                pass


def test_a_port_held_without_reuseport_is_a_clear_error():
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        with pytest.raises(RuntimeError, match="proxy_location: Disabled"):
            reuseport_socket("127.0.0.1", holder.getsockname()[1])
    finally:
        holder.close()


def test_listen_and_haproxy_are_not_both_the_front():
    base = {"models": [{"id": "m", "source": "smollm2-135m-instruct"}]}
    assert AppSettings.model_validate({**base, "ingress": {"listen": {"port": 8000}}}).ingress.listen.port == 8000
    with pytest.raises(ValueError, match="choose one"):
        AppSettings.model_validate({**base, "ingress": {"listen": {}, "direct_ingress": True}})
    with pytest.raises(ValueError, match="below the ingress deployment's graceful_shutdown_timeout_s"):
        AppSettings.model_validate({**base, "ingress": {"listen": {"drain_s": 20}}})
    with pytest.raises(ValueError, match="graceful_shutdown_timeout_s \\(30"):
        AppSettings.model_validate({**base, "ingress": {"listen": {"drain_s": 40},
                                                        "deployment": {"graceful_shutdown_timeout_s": 30}}})
    with pytest.raises(ValueError, match="front_door needs ingress.direct_ingress"):
        AppSettings.model_validate({**base, "engine_placement": "ingress", "router": {"front_door": True},
                                    "ingress": {"listen": {}}})


def test_the_listeners_defaults_are_serves_own():
    """The drain check assumes Serve's default graceful_shutdown_timeout_s, and idle connections are kept as long as
    Serve's own HTTP servers keep them: a Ray upgrade that moves either fails here."""
    from ray.serve._private.constants import DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S, DEFAULT_UVICORN_KEEP_ALIVE_TIMEOUT_S

    from serve_app.settings import IngressConfig, ListenConfig

    assert IngressConfig.SERVE_GRACEFUL_SHUTDOWN_S == DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S
    assert ListenConfig().keep_alive_s == DEFAULT_UVICORN_KEEP_ALIVE_TIMEOUT_S
