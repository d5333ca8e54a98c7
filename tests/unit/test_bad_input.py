"""The bad-input corpus against the body reader: every case is a 4xx ServiceError with a useful message."""

from __future__ import annotations

import asyncio
import gzip
import importlib.util
import io
import json
from pathlib import Path

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from serve_app.errors import ServiceError
from serve_app.ingress.body import MAX_DEPTH, check_structure, decode_content, read_json

_spec = importlib.util.spec_from_file_location(
    "bad_input_corpus", Path(__file__).resolve().parents[1] / "data" / "bad_input_corpus.py")
corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus)

MAX_BODY, MAX_DECOMPRESSED = 200_000, 400_000


def request(body: bytes, headers: dict[str, str], chunk: int = 65536) -> Request:
    hdrs = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]

    async def receive():
        if parts:
            part = parts.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(parts)}
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": hdrs}, receive)


def read(body: bytes, headers: dict[str, str]):
    return asyncio.run(read_json(request(body, headers), MAX_BODY, MAX_DECOMPRESSED))


@pytest.mark.parametrize("name, body, headers, statuses",
                         corpus.body_cases(MAX_BODY, MAX_DECOMPRESSED), ids=lambda v: v if isinstance(v, str) else "")
def test_corpus_case_is_a_4xx_service_error(name, body, headers, statuses):
    with pytest.raises(ServiceError) as e:
        read(body, headers)
    assert e.value.status in statuses, (name, e.value.status, e.value.message)
    assert e.value.message


def test_multi_member_gzip_and_multi_frame_zstd_are_whole_bodies():
    a, b = b'{"model": "m", ', b'"x": 1}'
    assert read(gzip.compress(a) + gzip.compress(b), {**corpus.JSON, "content-encoding": "gzip"}) == {"model": "m", "x": 1}
    z = zstandard.ZstdCompressor()
    assert read(z.compress(a) + z.compress(b), {**corpus.JSON, "content-encoding": "zstd"}) == {"model": "m", "x": 1}


def test_bomb_spread_over_members_is_still_capped():
    member = gzip.compress(b" " * (MAX_DECOMPRESSED // 3))
    with pytest.raises(ServiceError) as e:
        decode_content(member * 5, "gzip", MAX_DECOMPRESSED)
    assert e.value.status == 413


def test_zstd_without_content_size_is_capped():
    """A streamed zstd frame does not declare its size; the cap must hold anyway."""
    buf = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(buf, closefd=False) as w:
        for _ in range(100):
            w.write(b"A" * 10_000)
    assert zstandard.get_frame_parameters(buf.getvalue()).content_size == zstandard.CONTENTSIZE_UNKNOWN
    with pytest.raises(ServiceError) as e:
        decode_content(buf.getvalue(), "zstd", MAX_DECOMPRESSED)
    assert e.value.status == 413


def test_depth_limit_is_exact():
    ok: object = 1
    for _ in range(MAX_DEPTH - 1):
        ok = [ok]
    check_structure({"a": ok})  # MAX_DEPTH levels including the top object
    with pytest.raises(ServiceError):
        check_structure({"a": [ok]})


def test_good_body_with_unicode_and_escapes_passes():
    body = {"model": "m", "text": "😀 naïve \u2028 \\ud83d\\ude00", "nested": [[[{"k": None}]]]}
    assert read(json.dumps(body).encode(), corpus.JSON) == body
    assert read('{"s": "\\ud83d\\ude00"}'.encode(), corpus.JSON) == {"s": "😀"}  # a valid surrogate pair


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=2048), st.sampled_from([None, "gzip", "zstd", "deflate", "identity"]))
def test_arbitrary_bytes_never_raise_anything_but_a_4xx(raw, encoding):
    headers = dict(corpus.JSON)
    if encoding:
        headers["content-encoding"] = encoding
    try:
        body = read(raw, headers)
    except ServiceError as e:
        assert 400 <= e.status < 500
    else:
        assert isinstance(body, dict)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=8), _json, max_size=5),
       st.sampled_from([None, "gzip", "zstd"]))
def test_any_json_object_round_trips(obj, encoding):
    raw = json.dumps(obj).encode()
    headers = dict(corpus.JSON)
    if encoding == "gzip":
        raw, headers["content-encoding"] = gzip.compress(raw), "gzip"
    elif encoding == "zstd":
        raw, headers["content-encoding"] = zstandard.ZstdCompressor().compress(raw), "zstd"
    assert read(raw, headers) == obj
