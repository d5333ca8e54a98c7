"""Each API's errors come in its own envelope, chosen by the route that failed (serve_app/ingress/envelope.py)."""

from __future__ import annotations

import httpx

from serve_app.ingress.context import IngressContext
from serve_app.ingress.server import create_app
from serve_app.settings import AppSettings

SETTINGS = AppSettings.model_validate({"models": [{"id": "m1"}], "ingress": {"api_keys": ["k"]}})
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "wrong"}


def client() -> httpx.AsyncClient:
    app = create_app(IngressContext(settings=SETTINGS, service=None, secret=b"s"))  # auth fails before the service
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def is_anthropic(r: httpx.Response) -> bool:
    j = r.json()
    if j.get("type") == "error":
        assert r.headers["request-id"] == j["request_id"]
        return True
    assert set(j["error"]) == {"message", "type", "param", "code"}
    return False


async def test_the_route_not_the_headers_picks_the_envelope():
    async with client() as c:
        # An OpenAI route answers in OpenAI's envelope even to a client that sends Anthropic's headers.
        for path in ("/v1/chat/completions", "/v1/responses", "/v1/tokenize"):
            r = await c.post(path, json={}, headers=ANTHROPIC_HEADERS)
            assert r.status_code == 401 and not is_anthropic(r), path
        r = await c.post("/v1/messages", json={}, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and is_anthropic(r)
        assert r.json()["error"]["type"] == "authentication_error"


async def test_routes_serving_both_shapes_answer_errors_in_the_shape_asked_for():
    async with client() as c:
        r = await c.get("/v1/models", headers=ANTHROPIC_HEADERS)
        assert r.status_code == 401 and is_anthropic(r)
        r = await c.get("/v1/models", headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and not is_anthropic(r)


async def test_unrouted_requests_get_the_envelope_of_the_api_owning_the_path():
    async with client() as c:
        r = await c.get("/v1/messages")
        assert r.status_code == 405 and is_anthropic(r)
        r = await c.get("/v1/chat/completions")
        assert r.status_code == 405 and not is_anthropic(r)
        r = await c.get("/v1/nothing-here")
        assert r.status_code == 404 and not is_anthropic(r)
        r = await c.get("/v1/nothing-here", headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 404 and is_anthropic(r) and r.json()["error"]["type"] == "not_found_error"
