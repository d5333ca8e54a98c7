"""Discriminators for the open unions of the request schemas: a known `type` picks its model, anything else (an
unknown name, a missing field, a number, a list) picks the catch-all, which then validates or rejects it with a 400.
Never raises: a discriminator that raised TypeError on an unhashable `type` would turn bad input into a 500."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any


def type_discriminator(
    known: Collection[str],
    fallback: str,
    *,
    missing: str | None = None,
    aliases: Mapping[str, str] | None = None,
) -> Callable[[Any], str]:
    """A pydantic `Discriminator` function over the `type` field (dict input or model instance). `missing` is the
    tag for an absent `type` (Responses' messages may omit it); `aliases` map wire names onto a known tag."""
    known = frozenset(known)
    aliases = dict(aliases or {})

    def tag(v: Any) -> str:
        t = v.get("type", missing) if isinstance(v, dict) else getattr(v, "type", missing)
        if not isinstance(t, str):
            return fallback
        t = aliases.get(t, t)
        return t if t in known else fallback

    return tag
