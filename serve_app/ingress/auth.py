"""API-key check: `x-api-key` or `Authorization: Bearer`, compared in constant time."""

from __future__ import annotations

import hmac
from typing import Mapping

from serve_app.errors import ServiceError


def presented_key(headers: Mapping[str, str]) -> str | None:
    key = headers.get("x-api-key")
    if key:
        return key.strip()
    auth = headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return None


def check_api_key(headers: Mapping[str, str], api_keys: list[str]) -> None:
    """Raise 401 unless keys are configured-off or one of them matches."""
    if not api_keys:
        return
    key = presented_key(headers)
    if key is None:
        raise ServiceError("authentication", "missing API key: send x-api-key or Authorization: Bearer")
    ok = False
    for candidate in api_keys:  # no early exit: the time taken does not reveal which key matched
        ok |= hmac.compare_digest(key.encode(), candidate.encode())
    if not ok:
        raise ServiceError("authentication", "invalid API key")
