"""Reading request bodies: size caps, zstd/gzip decoding with a decompressed-size cap, JSON parsing.

Everything a client can get wrong here is a 4xx `ServiceError`, never an exception that would surface as a 500:
oversized or bomb bodies (413), unknown encodings or content types (415), truncated or corrupt compressed data,
invalid UTF-8, lone surrogates, NaN/Infinity, integers too long to convert, nesting deeper than `MAX_DEPTH`.
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any

from starlette.requests import Request

from serve_app.errors import InvalidRequest, ServiceError

# Deeper than any real request (tool schemas nest a few dozen levels at most); it keeps recursive code downstream
# (pydantic, converters, Jinja) far from Python's recursion limit.
MAX_DEPTH = 128
_SURROGATE = re.compile("[\ud800-\udfff]")


def _too_large(what: str, limit: int) -> ServiceError:
    return ServiceError("request_too_large", f"{what} exceeds the limit of {limit} bytes", code="request_too_large")


async def read_raw(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large("request body", max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large("request body", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _inflate(raw: bytes, enc: str, max_decompressed: int) -> bytes:
    """gzip (all members, as a concatenation of gzip files is one valid gzip stream) or deflate, capped."""
    wbits = 16 + zlib.MAX_WBITS if enc == "gzip" else zlib.MAX_WBITS
    out = bytearray()
    data = raw
    try:
        while True:
            d = zlib.decompressobj(wbits)
            out += d.decompress(data, max_decompressed + 1 - len(out))
            if len(out) > max_decompressed or d.unconsumed_tail:
                raise _too_large("decompressed request body", max_decompressed)
            if not d.eof:
                raise InvalidRequest(f"body is not valid {enc}: truncated stream")
            data = d.unused_data
            if enc != "gzip" or not data.strip(b"\x00"):
                break
    except zlib.error as e:
        raise InvalidRequest(f"body is not valid {enc}: {e}") from None
    return bytes(out)


def _unzstd(raw: bytes, max_decompressed: int) -> bytes:
    import zstandard

    out = bytearray()
    try:
        # read_across_frames: several concatenated frames are one body, as `zstd -d` treats them.
        with zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as reader:
            while len(out) <= max_decompressed:
                chunk = reader.read(min(1 << 20, max_decompressed + 1 - len(out)))
                if not chunk:
                    break
                out += chunk
    except zstandard.ZstdError as e:
        raise InvalidRequest(f"body is not valid zstd: {e}") from None
    if len(out) > max_decompressed:
        raise _too_large("decompressed request body", max_decompressed)
    if raw and not out and raw[:4] != b"\x28\xb5\x2f\xfd":
        raise InvalidRequest("body is not valid zstd: bad magic number")
    return bytes(out)


def decode_content(raw: bytes, encoding: str | None, max_decompressed: int) -> bytes:
    """Undo Content-Encoding, stopping as soon as the output passes the cap (so a bomb costs nothing)."""
    enc = (encoding or "identity").strip().lower()
    if enc in ("", "identity"):
        return raw
    if enc in ("gzip", "x-gzip", "deflate"):
        return _inflate(raw, "deflate" if enc == "deflate" else "gzip", max_decompressed)
    if enc == "zstd":
        return _unzstd(raw, max_decompressed)
    raise ServiceError("invalid_request", f"unsupported Content-Encoding: {encoding}", status=415)


def _reject_constant(name: str):
    raise InvalidRequest(f"request body is not valid JSON: {name} is not a JSON number")


def check_structure(body: Any, max_depth: int = MAX_DEPTH) -> None:
    """Iteratively (no recursion) reject nesting deeper than `max_depth` and strings with lone surrogates
    (valid JSON escapes like "\\ud800" that no UTF-8 encoder downstream can handle)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if depth > max_depth:
                raise InvalidRequest(f"request body nests deeper than {max_depth} levels")
            for k, v in value.items():
                if _SURROGATE.search(k):
                    raise InvalidRequest("request body has a key with an unpaired UTF-16 surrogate escape")
                stack.append((v, depth + 1))
        elif isinstance(value, list):
            if depth > max_depth:
                raise InvalidRequest(f"request body nests deeper than {max_depth} levels")
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str) and _SURROGATE.search(value):
            raise InvalidRequest("request body has a string with an unpaired UTF-16 surrogate escape")


def _check_content_type(request: Request) -> None:
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise ServiceError("invalid_request", f"unsupported Content-Type {ctype!r}: send application/json", status=415)


async def read_json(request: Request, max_bytes: int, max_decompressed: int) -> Any:
    _check_content_type(request)  # before reading: a wrong type costs no upload
    raw = await read_raw(request, max_bytes)
    data = decode_content(raw, request.headers.get("content-encoding"), max_decompressed)
    if not data.strip():
        raise InvalidRequest("request body is empty: expected a JSON object")
    try:
        text = data.decode("utf-8")  # explicit: json.loads(bytes) would guess UTF-16/32 from a BOM
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except ServiceError:
        raise
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    except ValueError as e:  # e.g. an integer literal longer than Python's int conversion limit
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    check_structure(body)
    return body
