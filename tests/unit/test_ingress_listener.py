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


async def test_the_listener_counts_the_requests_it_holds_open():
    """What the replica reports to Serve's autoscaler (ingress/autoscaling.py): a stream counts until its end."""
    release = asyncio.Event()
    listener = await started(Listener(app("x", release), "127.0.0.1", 0, keep_alive_s=5, drain_s=1))
    try:
        assert listener.open_requests == 0
        async with slow_stream(listener.port) as first, slow_stream(listener.port) as second:
            assert listener.open_requests == 2
            async with httpx.AsyncClient() as client:
                assert (await client.get(f"http://127.0.0.1:{listener.port}/hello")).text == "x"
            assert listener.open_requests == 2  # the short request came and went
            release.set()
            assert [b"".join([c async for c in s]) for s in (first, second)] == [b"last", b"last"]
        for _ in range(100):  # the server task finishes its side just after the client has the last byte
            if listener.open_requests == 0:
                break
            await asyncio.sleep(0.01)
        assert listener.open_requests == 0
    finally:
        await listener.drain()


def _context(per_replica: dict, serve_counted: float = 0.0, replicas: int | None = None, **config):
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    from serve_app.ingress.autoscaling import LISTENER_REQUESTS

    n = len(per_replica) if replicas is None else replicas
    return AutoscalingContext(
        deployment_id=None, deployment_name="Ingress", app_name="default", current_num_replicas=n,
        target_num_replicas=n, running_replicas=list(per_replica), total_num_requests=serve_counted,
        total_queued_requests=0.0, aggregated_metrics={LISTENER_REQUESTS: per_replica} if per_replica else {},
        raw_metrics={}, capacity_adjusted_min_replicas=config.get("min_replicas", 1),
        capacity_adjusted_max_replicas=config.get("max_replicas", 1), policy_state={}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=0.0, config=AutoscalingConfig(**config))


def test_the_listener_policy_scales_on_the_requests_the_replicas_ports_hold():
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    from serve_app.ingress.autoscaling import listener_policy

    busy = _context({"r1": 30.0, "r2": 34.0}, target_ongoing_requests=16, max_replicas=8)
    assert listener_policy(busy)[0] == 4.0  # 64 open requests at 16 each
    assert replica_queue_length_autoscaling_policy(busy)[0] == 0.0  # Serve's own count saw none of them
    assert listener_policy(_context({"r1": 6.0}, serve_counted=2.0, target_ongoing_requests=4))[0] == 2.0
    assert listener_policy(_context({"r1": 0.0, "r2": 0.0}, target_ongoing_requests=4))[0] == 0.0  # idle: Serve's min
    assert listener_policy(_context({}, replicas=0, target_ongoing_requests=4))[0] == 0  # nothing running to measure


def test_listen_with_autoscaling_scales_on_the_listeners_count():
    from ray.serve.config import AutoscalingConfig

    from serve_app.ingress.autoscaling import POLICY

    base = {"models": [{"id": "m", "source": "smollm2-135m-instruct"}]}
    scaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32}
    opts = AppSettings.model_validate({**base, "ingress": {"listen": {}, "deployment": {
        "autoscaling_config": scaling}}}).ingress.serve_options()
    assert opts["autoscaling_config"] == {**scaling, "policy": {"policy_function": POLICY}}
    assert AutoscalingConfig(**opts["autoscaling_config"]).policy.policy_function == POLICY  # Serve takes it
    own = {**scaling, "policy": {"policy_function": "mine:policy"}}
    assert AppSettings.model_validate({**base, "ingress": {"listen": {}, "deployment": {
        "autoscaling_config": own}}}).ingress.serve_options()["autoscaling_config"] == own
    behind_haproxy = AppSettings.model_validate({**base, "ingress": {"direct_ingress": True, "deployment": {
        "autoscaling_config": scaling}}}).ingress.serve_options()
    assert behind_haproxy["autoscaling_config"] == scaling  # Serve carries those requests and counts them itself
    with pytest.raises(ValueError, match="min_replicas must be at least 1 with ingress.listen"):
        AppSettings.model_validate({**base, "ingress": {"listen": {}, "deployment": {
            "autoscaling_config": {**scaling, "min_replicas": 0}}}})
