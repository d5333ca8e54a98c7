"""Body reading (caps, zstd/gzip bombs, JSON errors), API-key checks and SSE keep-alive."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest
import zstandard
from starlette.requests import Request

from serve_app.errors import ServiceError
from serve_app.ingress import sse
from serve_app.ingress.auth import check_api_key
from serve_app.ingress.body import read_json


def make_request(body: bytes, headers: dict[str, str] | None = None) -> Request:
    hdrs = [(k.lower().encode(), v.encode()) for k, v in (headers or {"content-type": "application/json"}).items()]
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": hdrs}, receive)


def read(body: bytes, headers=None, max_bytes=1000, max_decompressed=2000):
    return asyncio.run(read_json(make_request(body, headers), max_bytes, max_decompressed))


def test_plain_gzip_and_zstd_bodies():
    payload = {"model": "m", "x": "y" * 100}
    raw = json.dumps(payload).encode()
    assert read(raw) == payload
    assert read(gzip.compress(raw), {"content-type": "application/json", "content-encoding": "gzip"}) == payload
    assert read(zstandard.ZstdCompressor().compress(raw),
                {"content-type": "application/json", "content-encoding": "zstd"}) == payload


@pytest.mark.parametrize("encoding, compress", [
    ("gzip", gzip.compress),
    ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
])
def test_compression_bombs_are_413(encoding, compress):
    bomb = compress(b"{" + b" " * 10_000_000 + b"}")
    assert len(bomb) < 100_000
    with pytest.raises(ServiceError) as e:
        read(bomb, {"content-type": "application/json", "content-encoding": encoding}, max_bytes=100_000)
    assert e.value.status == 413


def test_oversized_body_is_413():
    with pytest.raises(ServiceError) as e:
        read(b"x" * 1001, max_bytes=1000)
    assert e.value.status == 413 and "limit" in e.value.message


@pytest.mark.parametrize("raw, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b"", 400, "empty"),
    (b"\xff\xfe{}", 400, "UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "JSON"),
])
def test_bad_bodies(raw, status, words):
    with pytest.raises(ServiceError) as e:
        read(raw, max_bytes=10_000_000)
    assert e.value.status == status and words in e.value.message


def test_wrong_content_type_and_encoding():
    with pytest.raises(ServiceError) as e:
        read(b"{}", {"content-type": "text/plain"})
    assert e.value.status == 415
    with pytest.raises(ServiceError) as e:
        read(b"{}", {"content-type": "application/json", "content-encoding": "br"})
    assert e.value.status == 415
    with pytest.raises(ServiceError) as e:
        read(b"garbage", {"content-type": "application/json", "content-encoding": "gzip"})
    assert e.value.status == 400


def test_api_keys():
    check_api_key({}, [])  # open when no keys are configured
    check_api_key({"x-api-key": "k2"}, ["k1", "k2"])
    check_api_key({"authorization": "Bearer k1"}, ["k1"])
    for headers in ({}, {"x-api-key": "nope"}, {"authorization": "Basic k1"}):
        with pytest.raises(ServiceError) as e:
            check_api_key(headers, ["k1"])
        assert e.value.status == 401


def test_keepalive_yields_none_while_idle_and_closes_the_source():
    closed = asyncio.Event()

    async def slow():
        try:
            await asyncio.sleep(0.25)
            yield "a"
            yield "b"
        finally:
            closed.set()

    async def run():
        got = [x async for x in sse.with_keepalive(slow(), 0.05)]
        return got

    got = asyncio.run(run())
    assert got[-2:] == ["a", "b"] and got.count(None) >= 2 and set(got[:-2]) == {None}


def test_keepalive_close_propagates():
    state = {"closed": False}

    async def endless():
        try:
            while True:
                await asyncio.sleep(0.01)
                yield 1
        finally:
            state["closed"] = True

    async def run():
        it = sse.with_keepalive(endless(), 1.0)
        assert await it.__anext__() == 1
        await it.aclose()

    asyncio.run(run())
    assert state["closed"]


def test_peek_replays_the_first_item_and_closing_closes_the_source():
    state = {"closed": False}

    async def source():
        try:
            for i in range(3):
                yield i
        finally:
            state["closed"] = True

    async def run():
        first, it = await sse.peek(source())
        assert first == 0 and [x async for x in it] == [0, 1, 2]
        state["closed"] = False
        first, it = await sse.peek(source())
        await it.aclose()  # closed before it was ever iterated: the source must still be closed
        assert state["closed"]
        empty_first, _ = await sse.peek(nothing())
        return empty_first

    async def nothing():
        return
        yield

    assert asyncio.run(run()) is sse.EMPTY


def test_frames():
    assert sse.frame({"a": 1}, "ping") == b'event: ping\ndata: {"a":1}\n\n'
    assert sse.frame({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()


def test_refusal_before_output_keeps_status_and_retry_after():
    from serve_app.conversation import Finish, TextDelta

    assert sse.refusal(sse.EMPTY).status == 500
    full = sse.refusal(Finish("error", error="the engine queue is full, retry shortly", error_kind="overloaded"))
    assert full.kind == "overloaded" and full.code == "server_is_overloaded" and full.retry_after > 0
    assert full.message == "the engine queue is full, retry shortly"
    failed = sse.refusal(Finish("error", error="boom", error_kind="api_error"))
    assert failed.status == 500 and failed.retry_after is None
    assert sse.refusal(TextDelta("hi")) is None
    assert sse.refusal(Finish("stop")) is None
