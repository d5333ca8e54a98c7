"""The Ingress deployment: FastAPI on Ray Serve. Thin: it wires the GenerationService and the routes."""

from __future__ import annotations

from ray import serve

from serve_app.ingress.clients import ServeEngineClient
from serve_app.ingress.context import IngressContext
from serve_app.ingress.limits import LimitClient
from serve_app.ingress.server import create_app
from serve_app.service import GenerationService
from serve_app.settings import AppSettings


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    def __init__(self, settings: dict, secret: bytes, engines: dict, router=None, extras: dict | None = None):
        cfg = AppSettings.model_validate(settings)
        client = ServeEngineClient(engines, router, router_timeout_s=cfg.ingress.router_timeout_s)
        limits = (extras or {}).get("tenant_limits")  # the shared TenantLimits handle, when a tenant has limits
        service = GenerationService(cfg, client, limiter=LimitClient(limits) if limits is not None else None)
        # Tokenizers load here, one after another: building them lazily from several request threads at once
        # raced inside transformers' lazy imports.
        service.warm_renderers()
        self.ctx = IngressContext(settings=cfg, service=service, secret=secret, extras=dict(extras or {}))

    def __serve_build_asgi_app__(self):
        return create_app(self.ctx)
