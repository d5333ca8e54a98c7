"""Bad request bodies every endpoint must answer with a 4xx in its own envelope (never a 5xx, never a hang).

BODY_CASES fail while the body is read (`serve_app/ingress/body.py`): size, encoding, UTF-8, JSON syntax, depth.
SCHEMA_CASES are well-formed JSON objects that are wrong for the API (types, unknown fields, huge values); they
are built per API from a valid minimal request by `schema_cases(api, model)`.
"""

from __future__ import annotations

import gzip
import json

import zstandard

JSON = {"content-type": "application/json"}
DEPTH = 5000


def _z(b: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(b)


def body_cases(max_body: int, max_decompressed: int) -> list[tuple[str, bytes, dict, set[int]]]:
    """(name, raw body, headers, allowed statuses) for the given caps."""
    bomb_src = b'{"a": "' + b"A" * (max_decompressed + 1024) + b'"}'
    return [
        ("empty", b"", JSON, {400}),
        ("whitespace", b"  \n ", JSON, {400}),
        ("truncated-json", b'{"model": "m", "messages": [', JSON, {400}),
        ("not-json", b"hello world", JSON, {400}),
        ("json-array", b"[1,2,3]", JSON, {400}),
        ("json-string", b'"just a string"', JSON, {400}),
        ("json-null", b"null", JSON, {400}),
        ("trailing-garbage", b'{"model": "m"} xyz', JSON, {400}),
        ("nan", b'{"model": "m", "temperature": NaN}', JSON, {400}),
        ("infinity", b'{"model": "m", "temperature": -Infinity}', JSON, {400}),
        ("huge-int", b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}", JSON, {400}),
        ("invalid-utf8", b'{"model": "m\xff\xfe"}', JSON, {400}),
        ("overlong-utf8", b'{"model": "\xc0\xaf"}', JSON, {400}),
        ("utf16-bom", '{"model": "m"}'.encode("utf-16"), JSON, {400}),
        ("lone-surrogate", b'{"model": "m", "x": "\\ud800"}', JSON, {400}),
        ("deep-array", b'{"a": ' + b"[" * DEPTH + b"]" * DEPTH + b"}", JSON, {400}),
        ("deep-object", b'{"a": ' + b'{"a": ' * DEPTH + b"1" + b"}" * DEPTH + b"}", JSON, {400}),
        ("deep-but-parseable", b'{"a": ' + b"[" * 500 + b"]" * 500 + b"}", JSON, {400}),
        ("too-large", b'{"a": "' + b"x" * (max_body + 10) + b'"}', JSON, {413}),
        ("gzip-bomb", gzip.compress(bomb_src), {**JSON, "content-encoding": "gzip"}, {413}),
        ("zstd-bomb", _z(bomb_src), {**JSON, "content-encoding": "zstd"}, {413}),
        ("gzip-corrupt", b"\x1f\x8b\x08\x00garbage", {**JSON, "content-encoding": "gzip"}, {400}),
        ("gzip-truncated", gzip.compress(b'{"model": "m"}')[:-6], {**JSON, "content-encoding": "gzip"}, {400}),
        ("zstd-corrupt", b"\x28\xb5\x2f\xfd garbage", {**JSON, "content-encoding": "zstd"}, {400}),
        ("zstd-not-zstd", b'{"model": "m"}', {**JSON, "content-encoding": "zstd"}, {400}),
        ("unknown-encoding", b'{"model": "m"}', {**JSON, "content-encoding": "br"}, {415}),
        ("text-plain", b'{"model": "m"}', {"content-type": "text/plain"}, {415}),
        ("form", b"model=m", {"content-type": "application/x-www-form-urlencoded"}, {415}),
        ("multipart", b"--x\r\n\r\n--x--", {"content-type": "multipart/form-data; boundary=x"}, {415}),
    ]


VALID = {
    "anthropic": lambda m: {"model": m, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    "chat": lambda m: {"model": m, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    "responses": lambda m: {"model": m, "max_output_tokens": 8, "input": "hi"},
}
ENDPOINTS = {"anthropic": "/v1/messages", "chat": "/v1/chat/completions", "responses": "/v1/responses"}


# Sampling fields that a token-counting endpoint ignores (Anthropic's count_tokens takes no max_tokens etc.).
SAMPLING_CASES = ("max_tokens-negative", "max_tokens-is-string", "temperature-string", "temperature-negative",
                  "stream-is-string")


def schema_cases(api: str, model: str, *, counting: bool = False) -> list[tuple[str, dict]]:
    """Well-formed JSON objects that are invalid requests for `api` (each must be a 4xx).

    A max_tokens above the model's limit is not among them: the service clamps it by design."""
    ok = VALID[api](model)
    msgs = "input" if api == "responses" else "messages"
    limit = "max_output_tokens" if api == "responses" else "max_tokens"
    cases: list[tuple[str, dict]] = [
        ("no-model", {k: v for k, v in ok.items() if k != "model"}),
        ("model-is-int", {**ok, "model": 123}),
        ("unknown-model", {**ok, "model": "no-such-model-anywhere"}),
        (f"{msgs}-missing", {k: v for k, v in ok.items() if k != msgs}),
        (f"{msgs}-is-number", {**ok, msgs: 42}),
        (f"{msgs}-is-object", {**ok, msgs: {"role": "user"}}),
        (f"{limit}-negative", {**ok, limit: -5}),
        (f"{limit}-is-string", {**ok, limit: "lots"}),
        ("temperature-string", {**ok, "temperature": "hot"}),
        ("temperature-negative", {**ok, "temperature": -3}),
        ("stream-is-string", {**ok, "stream": "yes please"}),
        ("tools-is-string", {**ok, "tools": "all of them"}),
        ("tools-bad-item", {**ok, "tools": [{"nonsense": True}]}),
        ("huge-model-name", {**ok, "model": "m" * 1_000_000}),
    ]
    if api != "responses":
        cases += [
            ("role-unknown", {**ok, "messages": [{"role": "wizard", "content": "hi"}]}),
            ("content-is-number", {**ok, "messages": [{"role": "user", "content": 7}]}),
            ("content-block-unknown-type", {**ok, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}),
            ("empty-messages", {**ok, "messages": []}),
        ]
    else:
        cases += [
            ("input-item-unknown-type", {**ok, "input": [{"type": "hologram"}]}),
            ("function-output-without-call", {**ok, "input": [{"type": "function_call_output", "output": "x"}]}),
        ]
    if counting:
        cases = [(n, b) for n, b in cases if n not in SAMPLING_CASES]
    return cases


def dumps(body: dict) -> bytes:
    return json.dumps(body).encode()
