"""Reading request bodies: size caps, zstd/gzip decoding with a decompressed-size cap, JSON parsing."""

from __future__ import annotations

import json
import zlib
from typing import Any

from starlette.requests import Request

from serve_app.errors import InvalidRequest, ServiceError


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


def decode_content(raw: bytes, encoding: str | None, max_decompressed: int) -> bytes:
    """Undo Content-Encoding, stopping as soon as the output passes the cap (so a bomb costs nothing)."""
    enc = (encoding or "identity").strip().lower()
    if enc in ("", "identity"):
        return raw
    if enc == "gzip" or enc == "deflate":
        wbits = 16 + zlib.MAX_WBITS if enc == "gzip" else zlib.MAX_WBITS
        d = zlib.decompressobj(wbits)
        try:
            out = d.decompress(raw, max_decompressed + 1)
        except zlib.error as e:
            raise InvalidRequest(f"body is not valid {enc}: {e}") from None
        if len(out) > max_decompressed or d.unconsumed_tail:
            raise _too_large("decompressed request body", max_decompressed)
        return out
    if enc == "zstd":
        import zstandard

        try:
            reader = zstandard.ZstdDecompressor().stream_reader(raw)
            out = reader.read(max_decompressed + 1)
        except zstandard.ZstdError as e:
            raise InvalidRequest(f"body is not valid zstd: {e}") from None
        if len(out) > max_decompressed:
            raise _too_large("decompressed request body", max_decompressed)
        return out
    raise ServiceError("invalid_request", f"unsupported Content-Encoding: {encoding}", status=415)


async def read_json(request: Request, max_bytes: int, max_decompressed: int) -> Any:
    raw = await read_raw(request, max_bytes)
    data = decode_content(raw, request.headers.get("content-encoding"), max_decompressed)
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype and ctype != "application/json" and not ctype.endswith("+json"):
        raise ServiceError("invalid_request", f"unsupported Content-Type {ctype!r}: send application/json", status=415)
    if not data.strip():
        raise InvalidRequest("request body is empty: expected a JSON object")
    try:
        text = data.decode("utf-8")  # explicit: json.loads(bytes) would guess UTF-16/32 from a BOM
    except UnicodeDecodeError as e:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body
