"""With the front door's routing (`router.front_door`): the end of every POST HAProxy forwarded, for the Router.

The Router reserves load on a replica when it answers HAProxy's hook, before the request arrives. A request that
reaches an engine reports its prefill and end from its stream (service.py); this middleware covers the rest, once
the response has been sent: a request that never reached an engine, and one that arrived without its route id
(a pin-miss delivered by Serve's fallback proxy). LocalEngineClient.settle decides which, if either, to report.
Pure ASGI, so streamed bodies pass through untouched and the report follows the response's last byte.
"""

from __future__ import annotations

from serve_app.routing.types import ROUTE_ID_HEADER

_ROUTE_ID = ROUTE_ID_HEADER.encode()
_REQUEST_ID = b"x-request-id"


class FrontDoorReportsMiddleware:
    def __init__(self, app, engines):
        """`engines`: the ingress's LocalEngineClient (anything with `settle(route_id, request_id)`)."""
        self.app = app
        self.engines = engines

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST":  # HAProxy asks the Router for POSTs only
            await self.app(scope, receive, send)
            return
        route_id = request_id = None
        for name, value in scope.get("headers", ()):
            if name == _ROUTE_ID:
                route_id = value.decode("latin-1")
            elif name == _REQUEST_ID:
                request_id = value.decode("latin-1")
        try:
            await self.app(scope, receive, send)
        finally:
            self.engines.settle(route_id, request_id)
