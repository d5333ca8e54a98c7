"""API-key check: `x-api-key` or `Authorization: Bearer`, compared in constant time; finds the caller's tenant."""

from __future__ import annotations

from typing import Mapping

from serve_app import tenants
from serve_app.settings import ApiKey
from serve_app.tenants import presented_key

__all__ = ["check_api_key", "presented_key"]


def check_api_key(headers: Mapping[str, str], api_keys: list[str | ApiKey]) -> str:
    """Raise 401 unless keys are configured-off or one of them matches; returns the tenant's name and makes it
    the current request's tenant (`tenants.CURRENT`, read by `GenerationService.prepare`)."""
    tenant = tenants.resolve(headers, api_keys)
    tenants.CURRENT.set(tenant)
    return tenant
