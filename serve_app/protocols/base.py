"""The base of every wire model: unknown fields are accepted and kept.

Clients add fields faster than servers learn them (new Claude Code and Codex builds send `client_metadata`,
`service_tier`, ...; cline#261, CLIProxyAPI#512): a field we do not know must never break a request. Strict on
types: a field we use must have the right type, and a wrong one becomes a 400 naming it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class OpenModel(BaseModel):
    model_config = ConfigDict(extra="allow")
