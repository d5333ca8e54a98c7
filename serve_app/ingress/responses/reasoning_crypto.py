"""Responses `reasoning.encrypted_content`: the server's reasoning, encrypted and authenticated with its key.

When a request's `include` has `reasoning.encrypted_content`, each reasoning item carries the exact reasoning text
sealed with AES-256-GCM under a key derived from the tenant's ring (`ctx.tenant_secret()`: the server secret,
shared by every ingress replica, derived for the tenant, so one tenant's items do not open for another). When the item
comes back in a later request the text is opened again, so the next prompt carries the model's own reasoning byte
for byte (prefix-cache reuse), and an item the server did not produce — or one altered in transit — is refused.

Blob: urlsafe-base64( b"r1" | 12-byte nonce | ciphertext+tag ). The associated data binds the blob to its purpose,
so a value sealed for another use of the same secret cannot be replayed here.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from serve_app.errors import InvalidRequest
from serve_app.keyring import keys_of

_VERSION = b"r1"
_AAD = b"serve_app/responses/reasoning/v1"
_NONCE = 12


def derive_key(secret: bytes) -> bytes:
    # A purpose-specific subkey: the same server secret also signs Anthropic thinking blocks.
    return hmac.new(secret, b"serve_app responses reasoning key", hashlib.sha256).digest()


class ReasoningSealer:
    """Seals with the newest key of the ring (serve_app/keyring.py); opens with any of them. `aad` names the use:
    a blob sealed for one (Responses items, Anthropic thinking signatures) does not open for another."""

    def __init__(self, secret: bytes, *, aad: bytes = _AAD):
        self._aeads = [AESGCM(derive_key(key)) for key in keys_of(secret)]
        self._aead = self._aeads[0]
        self._aad = aad

    def seal(self, text: str) -> str:
        nonce = os.urandom(_NONCE)
        blob = _VERSION + nonce + self._aead.encrypt(nonce, text.encode("utf-8"), self._aad)
        return base64.urlsafe_b64encode(blob).decode("ascii")

    def open(self, token: str, *, param: str = "input") -> str:
        """The reasoning text sealed in `token`; a 400 naming `param` if it was not sealed by this server."""
        try:
            blob = base64.urlsafe_b64decode(token.encode("ascii"))
        except (binascii.Error, ValueError, UnicodeEncodeError):
            blob = b""
        if len(blob) < len(_VERSION) + _NONCE + 16 or not blob.startswith(_VERSION):
            raise InvalidRequest(f"{param}: encrypted_content was not produced by this server", param=param,
                                 code="invalid_encrypted_content")
        nonce = blob[len(_VERSION):len(_VERSION) + _NONCE]
        for aead in self._aeads:
            try:
                plain = aead.decrypt(nonce, blob[len(_VERSION) + _NONCE:], self._aad)
                break
            except InvalidTag:
                continue
        else:
            raise InvalidRequest(f"{param}: encrypted_content failed verification (altered, or sealed by another "
                                 f"server key)", param=param, code="invalid_encrypted_content") from None
        return plain.decode("utf-8")
