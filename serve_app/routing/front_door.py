"""The front door's routing key with the engines in the ingress (`router.front_door`): which prompt a raw request
body will become, as the block hashes the KV index is keyed by.

With `engine_placement: ingress` each ingress replica runs its own engines, so the replica HAProxy forwards a
request to is the engine that serves it. Serve's HAProxy front door can ask a deployment first (its "ingress
request router" hook: `POST /internal/route` with the request's body, x-request-id and session header, answered
with the replica to forward to; routing/front_door_deployment.py). This module turns that body into the same
RouteRequest the ingress would build after parsing and rendering it: the API is told by the body's shape (the
hook does not pass the path), the body is parsed by that API's own adapter and rendered by the model's own
renderer, so the hashes equal the ones the serving engine's KV events report. A Responses continuation
(`previous_response_id`) is rendered with its history read from the Responses store the ingress uses, as the
ingress will read it, each read bounded so the hook still answers HAProxy in time. Anything it cannot read (not
JSON, truncated by HAProxy's buffer, an unknown model, a stored history that is missing or slower than that
bound) gives no hashes: the request is still routed, on load and session alone, and the ingress replica answers
any error in the API's own envelope. Routing never refuses a request.

Not seen here: the request's API key (HAProxy forwards no credentials) and headers other than the session id. The
key names the tenant, and a tenant's prompts are cached in its own namespace (vLLM's cache_salt, which the block
hashes start from: tenants.cache_salt). With one namespace the hashes are exact. With several, the prompt is hashed
in each that some replica holds its first block under, and the namespace with the longest run held wins: a later
turn's own history is cached under its tenant's namespace alone, so only a prompt several tenants have cached (a
first turn on a harness prompt they share) is a tie (`namespace_ties`). A later turn decided by its own history
also tells whose namespace its user's is (`GenerationOptions.user_key`: Claude Code's account and device, OpenAI's
safety_identifier or user), so that user's next first turn takes it (`namespace_ties_by_user`); a user not seen
yet gets the earliest namespace of the tie.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from serve_app import tenants
from serve_app.conversation import Message
from serve_app.keyring import KeyRing
from serve_app.routing.hashing import block_hashes, extend_block_hashes
from serve_app.routing.types import RouteRequest
from serve_app.settings import AppSettings

log = logging.getLogger(__name__)

# Content blocks only the Anthropic Messages API has (Chat uses `tool_calls` and role `tool`).
_ANTHROPIC_BLOCKS = frozenset({"tool_use", "tool_result", "thinking", "redacted_thinking", "document",
                               "server_tool_use", "web_search_tool_result"})
_CHAT_ROLES = frozenset({"system", "developer", "tool", "function"})


def detect_api(body: dict[str, Any]) -> str:
    """"responses", "messages" or "chat" from the body's shape. A simple request both Messages and Chat accept
    (user text only) renders the same prompt either way, so a wrong guess there costs nothing."""
    if "input" in body or "instructions" in body or "previous_response_id" in body:
        return "responses"
    if "system" in body or "anthropic_version" in body:
        return "messages"
    tools = body.get("tools")
    if isinstance(tools, list) and any(isinstance(t, dict) and "input_schema" in t for t in tools):
        return "messages"
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict):
                continue
            if m.get("role") in _CHAT_ROLES or "tool_calls" in m:
                return "chat"
            content = m.get("content")
            if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in _ANTHROPIC_BLOCKS
                                                 for b in content):
                return "messages"
    return "chat"


def _adapters() -> dict[str, Any]:
    # The ingress's own adapters: the same parse as the request will get there.
    from serve_app.ingress.anthropic.api import MESSAGES
    from serve_app.ingress.chat.api import CHAT
    from serve_app.ingress.responses.api import RESPONSES

    return {"messages": MESSAGES, "chat": CHAT, "responses": RESPONSES}


@dataclass(slots=True)
class Routed:
    engine_key: str | None  # None: the body named no model this app serves (or could not be read)
    request: RouteRequest
    api: str | None = None
    why_unkeyed: str | None = None  # why the request has no block hashes, when it has none


_UNKNOWN = object()  # a user whose namespace no decided turn has told yet
_USERS_KEPT = 100_000  # users whose namespace is remembered (a few hundred bytes each)


class HistoryReader:
    """The Responses store as the front door reads it: chains only (it never stores or deletes), each read
    bounded by `budget_s`. A slow store costs the request its prefix key, never its route: HAProxy gives up on the
    hook after its own timeout and forwards the request where it likes."""

    def __init__(self, store: Any, budget_s: float):
        """`store`: a StoreClient (ingress/responses/store.py), as the ingress reads the same store through."""
        self.store, self.budget_s = store, budget_s

    async def chain(self, key: str) -> list[Any] | None:
        try:
            return await asyncio.wait_for(self.store.chain(key), self.budget_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the Responses store did not answer within {self.budget_s:g} s") from None


class FrontDoor:
    def __init__(self, settings: AppSettings, secret: KeyRing, block_size: Callable[[str], int | None],
                 history: HistoryReader | None = None,
                 held_prefix: Callable[[str, list[int]], int] | None = None):
        """`block_size(engine_key)`: the engine's KV block size once one of its replicas registered, else None;
        `history`: the Responses store the ingress uses, None when the app has none; `held_prefix(engine_key,
        hashes)`: the longest leading run of `hashes` a replica holds (the Router's KV index), to tell which
        tenant's namespace a prompt is cached under when there are several."""
        from serve_app.ingress.context import IngressContext
        from serve_app.service import GenerationService

        self.settings = settings
        self.block_size = block_size
        # Renderers only: this service never reaches an engine.
        self.service = GenerationService(settings, engines=None)
        self.ctx = IngressContext(settings=settings, service=self.service, secret=secret, response_store=history,
                                  routing_only=True)
        self.salts = tenants.routing_salts(settings.ingress)
        self.held_prefix = held_prefix
        self.adapters = _adapters()
        self.keyed = self.unkeyed = 0
        self.namespace_ties = 0  # prompts held under several tenants' namespaces alike: the first one was taken
        self.namespace_ties_by_user = 0  # ... of which the user's namespace was known and taken
        # user key -> the namespace (cache salt) their later turns were last decided by, least recently used first.
        self._user_namespaces: OrderedDict[str, str | None] = OrderedDict()

    def warm(self) -> None:
        self.service.warm_renderers()

    async def route_request(self, body: bytes, request, request_id: str, session_id: str | None = None) -> Routed:
        """What the Router needs to choose a replica for this body. `request`: the hook's own HTTP request (its
        headers are the client's session id and request id)."""
        route = RouteRequest(request_id=request_id, session_key=session_id or None)
        try:
            data = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            return self._unkeyed(route, None, "body is not JSON (or was truncated by the front door's buffer)")
        if not isinstance(data, dict):
            return self._unkeyed(route, None, "body is not a JSON object")
        api = detect_api(data)
        if api == "responses" and data.get("previous_response_id") and self.ctx.response_store is None:
            key = self._engine_key(data.get("model"))
            return self._unkeyed(route, key, "the history is in a Responses store the front door has not got", api)
        try:
            call = await self.adapters[api].parse(data, request, self.ctx)
            renderer, model = await self.service.renderer_for(call.model)
            rendered = await renderer.render(call.conversation, call.options)
        except Exception as e:  # noqa: BLE001 - the ingress answers it in the API's own envelope
            return self._unkeyed(route, self._engine_key(data.get("model")), f"{type(e).__name__}: {e}"[:200], api)
        from serve_app.service import engine_key

        key = engine_key(model)
        opts = call.options
        route.session_key = opts.session_key or route.session_key
        route.num_prompt_tokens = len(rendered.token_ids)
        wanted = opts.max_tokens if opts.max_tokens is not None else model.max_output_tokens
        route.expected_output_tokens = opts.hints.osl or max(1, min(wanted, model.max_output_tokens, 512))
        block = self.block_size(key)
        if not block:
            return self._unkeyed(route, key, "no replica of the engine has registered yet", api)
        route.block_hashes = self._hashes(key, rendered.token_ids, block, opts.user_key, call.conversation.messages)
        self.keyed += 1
        return Routed(key, route, api)

    def _hashes(self, key: str, token_ids: list[int], block: int, user: str | None = None,
                messages: Sequence[Message] = ()) -> list[int]:
        """The prompt's block hashes in the namespace its longest cached run is held under (module docstring).
        A namespace no replica holds the first block under costs one block's hash, not the whole prompt's.
        `user`: who the session is for; `messages`: the prompt's, where one is an earlier answer a namespace
        holding more of the prompt than any other is the user's own."""
        default = self.salts[0]
        if len(self.salts) == 1 or self.held_prefix is None or len(token_ids) < block:
            return block_hashes(token_ids, block, salt=default)
        best: dict[str | None, list[int]] = {}  # the namespaces of the longest run held, in order
        best_run = 0
        default_first: list[int] = []
        for salt in self.salts:
            first = block_hashes(token_ids[:block], block, salt=salt)
            if salt == default:
                default_first = first
            if not self.held_prefix(key, first):
                continue
            hashes = extend_block_hashes(first, token_ids, block, salt=salt)  # the first block is hashed already
            run = self.held_prefix(key, hashes)
            if run > best_run:
                best, best_run = {salt: hashes}, run
            elif run == best_run:
                best[salt] = hashes
        if not best:
            return extend_block_hashes(default_first, token_ids, block, salt=default)
        if len(best) == 1:
            (salt, hashes), = best.items()
            if user and any(m.role == "assistant" for m in messages):
                self._learn(user, salt)
            return hashes
        self.namespace_ties += 1
        known = self._user_namespaces.get(user, _UNKNOWN) if user else _UNKNOWN
        if known in best:
            self.namespace_ties_by_user += 1
            self._user_namespaces.move_to_end(user)
            return best[known]
        return next(iter(best.values()))

    def _learn(self, user: str, salt: str | None) -> None:
        self._user_namespaces[user] = salt
        self._user_namespaces.move_to_end(user)
        while len(self._user_namespaces) > _USERS_KEPT:
            self._user_namespaces.popitem(last=False)

    def _engine_key(self, model_id: Any) -> str | None:
        from serve_app.service import engine_key

        model = self.settings.find_model(model_id) if isinstance(model_id, str) else None
        return engine_key(model) if model is not None else None

    def _unkeyed(self, route: RouteRequest, key: str | None, why: str, api: str | None = None) -> Routed:
        self.unkeyed += 1
        log.debug("front door: request %s routed without its prefix: %s", route.request_id, why)
        return Routed(key, route, api, why)
