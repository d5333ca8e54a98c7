"""What every route module gets: the settings and the GenerationService, hung on the FastAPI app's state.

A routes module exposes `router = APIRouter()`; its handlers take `ctx: IngressContext = Depends(get_ctx)`.
`serve_app/ingress/server.py` builds the FastAPI app, sets `app.state.ctx` and includes every router.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from serve_app.settings import AppSettings


@dataclass
class IngressContext:
    settings: AppSettings
    service: Any  # serve_app.service.GenerationService
    secret: bytes  # server key: signs thinking blocks, encrypts Responses reasoning
    extras: dict[str, Any] = field(default_factory=dict)  # e.g. "response_store": a handle to the shared store


def get_ctx(request: Request) -> IngressContext:
    return request.app.state.ctx
