"""Signatures for thinking blocks: an HMAC over the thinking text with the server key.

Every thinking block this server streams ends with one `signature_delta` carrying `sign(...)`. When a client sends
the block back in history, `verify` proves the text is what this deployment generated, so a tampered block (or
one signed by another server, e.g. the real API) is detected. The key is the tenant's (`ctx.tenant_secret()`,
derived from the server key ring every ingress replica shares), so any replica verifies any other's signature and
no tenant's verifies for another. With `thinking.display: "omitted"` the block goes out
without its text and the signature seals the text instead (`ThinkingSealer`, `unseal`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from serve_app.errors import InvalidRequest
from serve_app.ingress.responses.reasoning_crypto import ReasoningSealer
from serve_app.keyring import keys_of

PREFIX = "sa1."  # version tag: lets the format change without misreading old signatures
_DOMAIN = b"anthropic-thinking\x00"  # keeps these MACs from ever equalling another use of the same key
SEALED = "sa2."  # a signature that carries its block's text, sealed (`thinking.display: "omitted"`)
_SEALED_AAD = b"serve_app/anthropic/thinking/v1"  # a Responses encrypted_content blob does not open here


class ThinkingSigner:
    """Incremental: `update` per streamed delta (O(delta)), `signature()` once when the block closes."""

    __slots__ = ("_mac",)

    def __init__(self, secret: bytes):
        self._mac = hmac.new(secret, _DOMAIN, hashlib.sha256)

    def update(self, text: str) -> None:
        self._mac.update(text.encode("utf-8"))

    def signature(self) -> str:
        return PREFIX + base64.urlsafe_b64encode(self._mac.digest()).decode().rstrip("=")


def sign(secret: bytes, text: str) -> str:
    s = ThinkingSigner(secret)
    s.update(text)
    return s.signature()


def verify(secret: bytes, text: str, signature: str | None) -> bool:
    """True when any key of the ring (serve_app/keyring.py) signed `text` so: rotated keys keep verifying."""
    if not signature or not signature.startswith(PREFIX):
        return False
    ok = False
    for key in keys_of(secret):  # every key is tried: no early exit
        ok |= hmac.compare_digest(sign(key, text).encode(), signature.encode())
    return ok


class ThinkingSealer:
    """`thinking.display: "omitted"`: the block goes out with empty text, so its signature carries the text, sealed
    with the primitive Responses' `encrypted_content` uses (AES-GCM under the key ring), and the next turn replays
    the model's real reasoning. Same interface as ThinkingSigner; the text is kept until the block closes."""

    __slots__ = ("_parts", "_sealer")

    def __init__(self, secret: bytes):
        self._sealer = ReasoningSealer(secret, aad=_SEALED_AAD)
        self._parts: list[str] = []

    def update(self, text: str) -> None:
        self._parts.append(text)

    def signature(self) -> str:
        return SEALED + self._sealer.seal("".join(self._parts))


def unseal(secret: bytes, signature: str) -> str | None:
    """The thinking text sealed in a `SEALED` signature, or None when this server's key ring did not seal it."""
    if not signature.startswith(SEALED):
        return None
    try:
        return ReasoningSealer(secret, aad=_SEALED_AAD).open(signature[len(SEALED):])
    except InvalidRequest:
        return None
