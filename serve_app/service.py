"""GenerationService: the one pipeline every API adapter drives (docs/architecture.md, steps 3-6).

An adapter turns its wire request into `(Conversation, GenerationOptions)` and then:

    prepared = await service.prepare(conv, opts, model_id)       # render + tokenize + limits (may raise ServiceError)
    async for ev in service.stream(prepared): ...                # parser events, then Usage, then Finish
    n = await service.count_tokens(conv, opts, model_id)         # == prepared.num_prompt_tokens for the same request

`stream` yields the IR's semantic events: ReasoningDelta / TextDelta / ToolCallStart / ToolCallArgsDelta /
ToolCallEnd as the parser produces them, then exactly one `Usage` and one `Finish` last. An engine failure after
the stream began ends it with `Finish(reason="error", error=...)` (never an exception), so each adapter can emit
its protocol's error event. Closing the iterator (client disconnect) aborts the engine request.

The non-streaming form is the same stream folded (`conversation.fold_events`), so the two cannot disagree.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

from serve_app import metrics, request_log, tenants
from serve_app.conversation import (
    Conversation,
    Event,
    Finish,
    FinishReason,
    GenerationOptions,
    OutputFormat,
    ReasoningDelta,
    TextPart,
    ToolCallEnd,
    ToolResultPart,
    ToolSpec,
    Usage,
    complete_answer,
)
from serve_app.engine.provision import ensure_model
from serve_app.engine.types import EngineChunk, EngineRequest
from serve_app.errors import InvalidRequest, ModelNotFound, Overloaded, PromptTooLong, ServiceError, replica_gone
from serve_app.parsers import answer_required, make_stream_parser, needs_special_tokens
from serve_app.parsers import tool_grammar
from serve_app.prompt import PromptRenderer, load_tokenizer
from serve_app.routing.hashing import block_hashes
from serve_app.routing.types import Decision, RouteRequest
from serve_app.settings import AppSettings, ModelConfig

log = logging.getLogger(__name__)

# A non-streamed request whose engine replica is lost after its first delta has shown the client nothing yet: it
# starts again on a live replica, up to this many times (a streamed one has sent those deltas: it fails).
_LOST_RESTARTS = 2


class Restarted:
    """In a restartable stream (`complete`): the events before this came from an attempt whose replica was lost."""


RESTARTED = Restarted()


@dataclass(eq=False)
class PreparedRequest:
    request_id: str
    model_id: str  # the id the client asked for (echoed back)
    model: ModelConfig
    conversation: Conversation
    options: GenerationOptions
    prompt_token_ids: list[int]
    max_tokens: int  # clamped to what fits in the context
    # Whose limit max_tokens is, so what a length stop means (docs/limits.md): "length" the client's (or the cap
    # the client left standing), "output_cap" the model's cap below what the client asked, "context_window" the
    # room left in the context, below both.
    length_stop: FinishReason = "length"
    starts_in_reasoning: bool | None = None  # the rendered prompt ends inside an open think block
    tool_schemas: list[dict[str, Any]] = field(default_factory=list)  # OpenAI-style function schemas for the parser
    created: float = 0.0  # time.monotonic() at admission, for TTFT
    # time.monotonic() as the request passes each step before its first token (render, tenant, route, accept,
    # first_token): the request log's `phases_ms` says where a slow TTFT went
    marks: dict[str, float] = field(default_factory=dict)
    received: float = 0.0  # time.monotonic() when the HTTP request arrived, when the edge said so
    tenant: str | None = None  # serve_app/tenants.py
    cache_salt: str | None = None  # the tenant's prefix-cache namespace (vLLM cache_salt; the router's hashes too)
    _release: Any = None  # frees this request's admission slot and tenant lease: _release(output_tokens) (idempotent)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def release(self, output_tokens: int):
        """Free the admission slot and tenant lease, if admission took any (idempotent). Returns the tenant
        release still in flight, if any (`LimitClient.release`)."""
        if self._release is not None:
            return self._release(output_tokens)
        return None


class EngineClient(Protocol):
    """How the service reaches engines and the router; the Ray implementation is in serve_app/ingress/clients.py."""

    async def block_size(self, engine_key: str) -> int: ...

    async def reasoning_gate(self, engine_key: str) -> bool:
        """Whether the engine holds grammars back until a think block ends (vLLM's reasoning parser is on)."""
        ...

    async def probe(self, engine_key: str) -> None:
        """Return once a replica of this engine answers (the caller bounds the wait); raise if it fails."""
        ...

    async def choose(self, engine_key: str, req: RouteRequest) -> Decision | None: ...

    def prefilled(self, engine_key: str, request_id: str, cached_tokens: int | None = None) -> None: ...

    def release(self, engine_key: str, request_id: str, output_tokens: int | None = None) -> None: ...

    async def open(self, engine_key: str, req: EngineRequest) -> AsyncIterator[EngineChunk]:
        """The request's chunks, returned once a replica has taken it; raises (e.g. Serve's BackPressureError)
        when none will, before anything has been streamed."""
        ...

    # Optional, where the client knows other replicas (ingress/clients.py): `async reopen(engine_key, req, lost)`
    # starts `req` again after its replica was lost midway (`lost`), raising `lost` when no live replica takes it.


def engine_key(model: ModelConfig) -> str:
    """Models with the same weights and engine settings share one Engine deployment; this names it."""
    ident = json.dumps(
        [model.model_source, model.max_model_len, model.hf_overrides, model.engine_kwargs, model.engine_env]
        + ([model.sliding_window] if model.sliding_window else []),  # absent: keys of existing configs unchanged
        sort_keys=True,
        default=str,
    )
    slug = re.sub(r"[^A-Za-z0-9]+", "-", model.model_source.split("/")[-1]).strip("-")[:40]
    return f"Engine-{slug}-{hashlib.sha256(ident.encode()).hexdigest()[:8]}"


def tool_schemas(tools: list[ToolSpec]) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tools
    ]


def _map_finish(chunk: EngineChunk, saw_tool_call: bool, length_stop: FinishReason = "length") -> Finish:
    if chunk.finish_reason == "length":
        return Finish(length_stop)
    if chunk.finish_reason == "abort":
        return Finish("abort")
    if chunk.finish_reason == "error":
        return Finish("error", error=chunk.error or "engine error", error_kind="api_error")
    if isinstance(chunk.stop_reason, str):
        return Finish("stop_sequence", stop_sequence=chunk.stop_reason)
    return Finish("tool_calls" if saw_tool_call else "stop")


class GenerationService:
    def __init__(self, settings: AppSettings, engines: EngineClient, tokenizer_loader=None, model_paths=None,
                 limiter=None):
        self.settings = settings
        self.engines = engines
        self.limiter = limiter  # serve_app/ingress/limits.LimitClient; None = no tenant has limits
        self._model_paths: dict[str, str] = dict(model_paths or {})
        self._tokenizer_loader = tokenizer_loader
        self._renderers: dict[str, PromptRenderer] = {}  # model id -> renderer (immutable after creation)
        self._render_locks: dict[str, asyncio.Lock] = {}
        self._inflight = 0
        self._background: set[asyncio.Task] = set()

    # -- models ---------------------------------------------------------------------------------------------

    def list_models(self) -> list[ModelConfig]:
        return list(self.settings.models)

    def resolve_model(self, model_id: str | None) -> ModelConfig:
        if not model_id:
            raise InvalidRequest("model: field required", param="model")
        model = self.settings.find_model(model_id)
        if model is None:
            raise ModelNotFound(model_id)
        return model

    def model_path(self, model: ModelConfig) -> str:
        path = self._model_paths.get(model.model_source)
        if path is None:
            path = ensure_model(model.model_source, self.settings.model_cache_dir)
            self._model_paths[model.model_source] = path
        return path

    async def renderer_for(self, model_id: str) -> tuple[PromptRenderer, ModelConfig]:
        """(PromptRenderer, ModelConfig) for a served id; the tokenizer loads once, off the event loop."""
        model = self.resolve_model(model_id)
        renderer = self._renderers.get(model.id)
        if renderer is not None:
            return renderer, model
        lock = self._render_locks.setdefault(model.id, asyncio.Lock())
        async with lock:
            renderer = self._renderers.get(model.id)
            if renderer is None:
                renderer = await asyncio.to_thread(self._make_renderer, model)
                self._renderers[model.id] = renderer
        return renderer, model

    def warm_renderers(self) -> None:
        """Load every model's tokenizer and template now (at replica start), not on the first request."""
        for model in self.settings.models:
            if model.id not in self._renderers:
                self._renderers[model.id] = self._make_renderer(model)

    def _make_renderer(self, model: ModelConfig):
        path = self.model_path(model)
        loader = self._tokenizer_loader or load_tokenizer
        tok = loader(path, model.chat_template)
        return PromptRenderer(
            tok,
            model,
            strip_preamble=self.settings.ingress.strip_preamble,
            render_timeout_s=self.settings.ingress.render_timeout_s,
            render_threads=self.settings.ingress.render_threads,
            inline_chars=self.settings.ingress.render_inline_chars,
        )

    async def readiness(self, timeout_s: float = 5.0) -> dict[str, str | None]:
        """Each engine deployment this app serves -> None when one of its replicas answered, else why not.
        Asked in parallel, so a hung engine costs one timeout, not one per model."""
        keys = sorted({engine_key(m) for m in self.settings.models})

        async def one(key: str) -> str | None:
            try:
                await asyncio.wait_for(self.engines.probe(key), timeout_s)
                return None
            except asyncio.TimeoutError:
                return f"no answer within {timeout_s:g} s"
            except Exception as e:  # noqa: BLE001 - reported, not raised: readiness is a report
                return f"{type(e).__name__}: {e}"[:300]

        return dict(zip(keys, await asyncio.gather(*(one(k) for k in keys))))

    # -- prompt ---------------------------------------------------------------------------------------------

    async def count_tokens(self, conv: Conversation, opts: GenerationOptions, model_id: str) -> int:
        renderer, _ = await self.renderer_for(model_id)
        rendered = await renderer.render(conv, opts)
        return len(rendered.token_ids)

    async def prepare(self, conv: Conversation, opts: GenerationOptions, model_id: str,
                      received: float | None = None, routed: float | None = None) -> PreparedRequest:
        """`received`: time.monotonic() when the HTTP request arrived (the request log's phases start there);
        `routed`: when its route began (the `http` phase ends there)."""
        renderer, model = await self.renderer_for(model_id)
        wrong = tool_grammar.check_choice(conv.tool_choice, conv.tools)
        if wrong:
            raise InvalidRequest(wrong, param="tool_choice")
        tenant = tenants.CURRENT.get() or tenants.DEFAULT  # set by the route's key check
        tenants.check_model(self.settings.ingress, tenant, model)
        # The slot is taken before the first await: a burst whose checks all ran before any render finished
        # would otherwise slip past the limit together (seen in the overload fault test).
        release = self._admit()
        try:
            prepared = await self._prepare_admitted(renderer, model, conv, opts, model_id)
            if received is not None:
                prepared.received = received
                if routed is not None:
                    prepared.marks["http"] = routed
                prepared.marks["parse"] = prepared.created
            prepared.marks["render"] = time.monotonic()
            prepared.tenant = tenant
            prepared.cache_salt = tenants.cache_salt(self.settings.ingress, tenant)
            release = await self._tenant_admit(prepared, release)
            prepared.marks["tenant"] = time.monotonic()
        except BaseException:
            release()
            raise
        prepared._release = release
        weakref.finalize(prepared, release)  # an adapter that fails before streaming still frees the slot
        return prepared

    async def _tenant_admit(self, prepared: PreparedRequest, release):
        """Take a slot under the tenant's limits (state shared by all ingress replicas), or raise a 429;
        returns the release that frees both slots and counts the output tokens."""
        cfg = tenants.config_of(self.settings.ingress, prepared.tenant)
        if self.limiter is None or not cfg.limited:
            metrics.observe_tenant(prepared.tenant, "admitted")
            return release
        try:
            verdict = await self.limiter.acquire(prepared.tenant, cfg, prepared.num_prompt_tokens)
        except ServiceError as e:
            if e.kind == "rate_limit":
                metrics.observe_tenant(prepared.tenant, getattr(e, "limit", None) or "rate_limit")
                self._log(prepared, finish_reason="rate_limited", error=e.message)
            raise
        metrics.observe_tenant(prepared.tenant, "admitted")
        limiter, lease, done = self.limiter, verdict.lease, [False]

        def release_both(output_tokens: int = 0):
            release()
            if not done[0]:
                done[0] = True
                return limiter.release(lease, output_tokens)
            return None

        return release_both

    def _admit(self):
        """Count one request in flight, or refuse it fast with a retry-after; returns the idempotent release."""
        limit = self.settings.ingress.max_inflight_requests
        if limit and self._inflight >= limit:
            raise Overloaded(retry_after=1.0)
        self._inflight += 1
        metrics.set_queue_depth("ingress", self._inflight)
        released = [False]

        def release(output_tokens: int = 0) -> None:
            if not released[0]:
                released[0] = True
                self._inflight -= 1
                metrics.set_queue_depth("ingress", self._inflight)

        return release

    async def _prepare_admitted(self, renderer, model, conv, opts, model_id) -> PreparedRequest:
        started = time.monotonic()
        rendered = await renderer.render(conv, opts)
        if opts.logit_bias:
            _check_logit_bias(opts.logit_bias, renderer.vocab_size)
        n = len(rendered.token_ids)
        if n >= model.max_model_len:
            raise PromptTooLong(n, model.max_model_len)
        room = model.max_model_len - n
        wanted = opts.max_tokens if opts.max_tokens is not None else model.max_output_tokens
        if wanted < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        limit = min(wanted, model.max_output_tokens)  # too large a request is clamped to the cap, not refused
        max_tokens = min(limit, room)  # and to the room left; if that binds, the stop is the context's
        prepared = PreparedRequest(
            request_id=uuid.uuid4().hex,
            model_id=model_id,
            model=model,
            conversation=conv,
            options=opts,
            prompt_token_ids=rendered.token_ids,
            max_tokens=max_tokens,
            # a stop at the cap is the deployment's, not the client's, when the client set no limit or a larger one
            length_stop=("context_window" if room < limit
                         else "output_cap" if opts.max_tokens is None or wanted > model.max_output_tokens
                         else "length"),
            # the rendered prompt decides (it ends inside an open think block or not), not the parser's default
            starts_in_reasoning=rendered.starts_in_reasoning,
            tool_schemas=tool_schemas(conv.tools),
            created=started,
        )
        return prepared

    # -- generation -----------------------------------------------------------------------------------------

    def _forced_script(self, prepared: PreparedRequest) -> str | None:
        testing = self.settings.testing
        if not testing.forced_scripts:
            return None
        if prepared.options.forced_script is not None:
            return prepared.options.forced_script
        if testing.script_rules:
            last = _last_input_text(prepared.conversation)
            for rule in testing.script_rules:
                if (rule.model is None or rule.model == prepared.model_id) and re.search(rule.match, last):
                    return rule.script
        return None

    def _constraint(self, prepared: PreparedRequest, reasoning_gate: bool) -> dict | None:
        """The grammar for this request: the tool choice's (parsers/tool_grammar.py) where it forces or forbids
        calls, else the requested output format's. A forced script is exact text already and takes none."""
        conv, model = prepared.conversation, prepared.model
        tag = tool_grammar.structural_tag(
            model.tool_parser, conv.tools, conv.tool_choice, reasoning=model.reasoning_parser,
            starts_in_reasoning=bool(prepared.starts_in_reasoning), reasoning_gate=reasoning_gate,
        )
        fmt = prepared.options.output_format
        if tag is not None and (fmt is None or conv.tool_choice.mode in ("required", "tool")):
            return tool_grammar.engine_constraint(tag)
        return _engine_constraint(fmt)

    def _engine_request(self, prepared: PreparedRequest, renderer, reasoning_gate: bool = False) -> EngineRequest:
        opts = prepared.options
        req = EngineRequest(
            request_id=prepared.request_id,
            prompt_token_ids=prepared.prompt_token_ids,
            max_tokens=prepared.max_tokens,
            temperature=opts.temperature,
            top_p=opts.top_p,
            top_k=opts.top_k,
            seed=opts.seed,
            frequency_penalty=opts.frequency_penalty,
            presence_penalty=opts.presence_penalty,
            logit_bias=opts.logit_bias,
            stop=list(opts.stop),
            priority=tenants.engine_priority(self.settings.ingress, prepared.tenant, opts.hints.priority),
            tenant=prepared.tenant if self.settings.ingress.fair_share else None,
            share=tenants.config_of(self.settings.ingress, prepared.tenant).share,
            skip_special_tokens=not needs_special_tokens(prepared.model.reasoning_parser, prepared.model.tool_parser),
            ignore_eos=opts.ignore_eos,
            min_tokens=opts.min_tokens,
            cache_salt=prepared.cache_salt,
        )
        script = self._forced_script(prepared)
        if script is not None:
            tok = renderer.tokenizer
            req.forced_token_ids = tok.encode(script, add_special_tokens=False)
            req.forced_eos_id = tok.eos_token_id
        else:
            req.structured = self._constraint(prepared, reasoning_gate)
        return req

    def stream(self, prepared: PreparedRequest, restartable: bool = False) -> AsyncIterator[Event]:
        """`restartable`: the caller shows the client nothing until the end, so a lost replica's request may start
        again; it then drops every event before each `RESTARTED` (only `complete` does)."""
        return metrics.instrument_stream(metrics.CURRENT_API.get(), self._stream(prepared, restartable),
                                         prepared.created or None, prepared.tenant)

    async def _stream(self, prepared: PreparedRequest, restartable: bool = False) -> AsyncIterator[Event]:
        model = prepared.model
        key = engine_key(model)
        renderer, _ = await self.renderer_for(model.id)
        n_prompt = prepared.num_prompt_tokens
        decision: Decision | None = None
        chunks: AsyncIterator[EngineChunk] | None = None
        engine_req: EngineRequest | None = None
        completion = 0
        outcome: dict[str, Any] = {}  # what the request log records of this stream
        route_id = prepared.options.route_id or prepared.request_id  # what the Router's load is kept under
        try:
            block = await self.engines.block_size(key)
            route = RouteRequest(
                request_id=route_id,
                block_hashes=block_hashes(prepared.prompt_token_ids, block, salt=prepared.cache_salt),
                num_prompt_tokens=n_prompt,
                expected_output_tokens=prepared.options.hints.osl or min(prepared.max_tokens, 512),
                session_key=prepared.options.session_key,
            )
            decision = await self.engines.choose(key, route)
            prepared.marks["route"] = time.monotonic()

            # vLLM's reasoning gate (engine-wide) decides whether a tool-choice grammar starts at the think block
            gate = bool(model.reasoning_parser) and await self.engines.reasoning_gate(key)
            engine_req = self._engine_request(prepared, renderer, gate)
            if decision is not None:
                engine_req.target_replica = engine_req.reserved_on = decision.replica_id
            warm = prepared.options.hints.speculative_prefill
            predicted = min(decision.cached_blocks * block, max(n_prompt - 1, 0)) if decision else 0
            restarts = 0
            wants_answer = answer_required(model.reasoning_parser, prepared.options.chat_template_kwargs,
                                           prepared.options.thinking)
            lost: Exception | None = None  # what ended the last attempt, when it runs again
            while True:
                parser = make_stream_parser(
                    reasoning=model.reasoning_parser,
                    tools=model.tool_parser if prepared.conversation.tools or model.tool_parser else None,
                    tool_schemas=prepared.tool_schemas,
                    starts_in_reasoning=prepared.starts_in_reasoning,
                    answer_required=wants_answer,
                )
                reasoning_tokens = cached = completion = 0
                saw_tool = False
                generated: list[int] = []  # kept only to warm the next turn's prefix
                last: EngineChunk | None = None
                # Opened before anything is yielded: an engine that refuses (queue full) fails the request while
                # the adapter can still answer with a plain 429/529 instead of an in-stream error.
                chunks = await (self.engines.open(key, engine_req) if lost is None
                                else self.engines.reopen(key, engine_req, lost))
                prepared.marks.setdefault("accept", time.monotonic())
                yield Usage(prompt_tokens=n_prompt, completion_tokens=0, cached_tokens=predicted, estimated=True)
                try:
                    async for chunk in chunks:
                        last = chunk
                        if "ttft" not in outcome and (chunk.token_ids or chunk.finish_reason is not None):
                            outcome["ttft"] = prepared.marks["first_token"] = time.monotonic()
                        if chunk.engine_ms is not None:
                            outcome["engine_ms"] = chunk.engine_ms
                        if chunk.num_cached_tokens is not None:
                            cached = outcome["cached"] = chunk.num_cached_tokens
                            if decision is not None:  # the Router learns this replica's prefill rate from it
                                self.engines.prefilled(key, route_id, cached)
                        completion += len(chunk.token_ids)
                        if warm:
                            generated.extend(chunk.token_ids)
                        events = parser.push(chunk.text, chunk.token_ids) if chunk.text or chunk.token_ids else []
                        if events and all(isinstance(e, ReasoningDelta) for e in events):
                            reasoning_tokens += len(chunk.token_ids)
                        for ev in events:
                            if isinstance(ev, ToolCallEnd):  # a call cut off or abandoned as malformed never ends
                                saw_tool = True
                            yield ev
                        if chunk.finish_reason is not None:
                            break
                    break
                except Exception as e:
                    # Nothing of this attempt reached the client (the caller folds the whole answer): start it
                    # again on a live replica rather than fail, where the engine client knows replicas to hand it
                    # to (ingress/clients.py; the engines in this process have none). Its own failover restarts
                    # only before a first delta.
                    if (not (restartable and engine_lost(e) and getattr(self.engines, "reopen", None) is not None)
                            or restarts == _LOST_RESTARTS):
                        raise
                    log.warning("replica of request %s lost after %d tokens (%s); starting it again",
                                prepared.request_id, completion, type(e).__name__)
                    restarts += 1
                    lost = e
                    await _close(chunks)
                    yield RESTARTED
            for ev in parser.finish():
                if isinstance(ev, ToolCallEnd):
                    saw_tool = True
                yield ev
            yield Usage(n_prompt, completion, cached_tokens=cached, reasoning_tokens=reasoning_tokens)
            if last is None or last.finish_reason is None:
                outcome["finish"] = "error"
                yield Finish("error", error="the engine ended the stream without finishing", error_kind="api_error")
            else:
                fin = _map_finish(last, saw_tool, prepared.length_stop)
                outcome["finish"] = fin.reason
                # Before the final frame goes out: a client that sends its next request the moment it reads the
                # end must find the tenant's slot free (released again, idempotently, in `finally`). The shared
                # limit state is another process: wait for the release to land there, not just to be sent.
                pending = prepared.release(completion)
                if pending is not None and self.limiter is not None:
                    await self.limiter.settled(pending)
                yield fin
                if warm and last.finish_reason in ("stop", "length"):
                    self._warm_next_turn(key, engine_req, generated)
        except asyncio.CancelledError:
            outcome["finish"] = "cancelled"
            raise
        except ServiceError as e:
            outcome.update(finish="error", error=e.message)
            yield Finish("error", error=e.message, error_kind=e.kind, retry_after=e.retry_after)
        except Exception as e:  # an engine/replica failure mid-stream: report it in-protocol, never hang
            kind, message = _classify_engine_error(e)
            log.warning("request %s failed: %s", prepared.request_id, message)
            outcome.update(finish="error", error=message)
            yield Finish("error", error=message, error_kind=kind)
        finally:
            prepared.release(completion)
            outcome.setdefault("finish", "cancelled")  # closed by the client (GeneratorExit) before the end
            # The replica that ran it (ingress/clients.py keeps it on the request once one accepts): Serve's own
            # pick or a handover may differ from the decision.
            ran_on = engine_req.target_replica if engine_req is not None else None
            self._log(prepared, decision=decision, replica=ran_on, output_tokens=completion, **outcome)
            if chunks is not None:
                await _close(chunks)
            if decision is not None:  # with the real output count: the Router learns the decode rate from it
                self.engines.release(key, route_id, completion)

    def _log(self, prepared: PreparedRequest, *, decision: Decision | None = None, replica: str | None = None,
             output_tokens: int = 0,
             finish: str | None = None, finish_reason: str | None = None, cached: int | None = None,
             ttft: float | None = None, error: str | None = None,
             engine_ms: dict[str, float] | None = None) -> None:
        ing = self.settings.ingress
        if not ing.log_requests:
            return
        try:
            start = prepared.created or None
            # Why this replica: the Router's policy (with the blocks it believed cached), or Serve's own
            # least-loaded choice when the Router did not answer in time.
            route = decision.policy if decision is not None else ("not routed" if finish_reason else
                                                                   "serve least-loaded (no router decision)")
            fields = request_log.record(
                request_id=prepared.request_id,
                tenant=prepared.tenant,
                api=metrics.CURRENT_API.get(),
                model=prepared.model_id,
                prompt_tokens=prepared.num_prompt_tokens,
                cached_tokens=cached,
                output_tokens=output_tokens,
                ttft_s=(ttft - start) if ttft is not None and start else None,
                duration_s=(time.monotonic() - start) if start else None,
                finish_reason=finish_reason or finish,
                replica=replica or (decision.replica_id if decision is not None else None),
                route=route,
                predicted_cached=decision.cached_blocks if decision is not None else None,
                phases_ms=_phases_ms(prepared.received or start, prepared.marks) if start else None,
                engine_ms=engine_ms,
                error=error,
                text=_last_input_text(prepared.conversation) if ing.log_request_text else None,
            )
            request_log.emit(fields)
        except Exception as e:  # noqa: BLE001 - the log never fails a request
            log.debug("request log failed: %s", e)

    def _warm_next_turn(self, key: str, done: EngineRequest, generated: list[int]) -> None:
        """`agent_hints.speculative_prefill`: the next turn starts with this prompt plus this answer, so prefill
        that on the same replica now (one token, lowest priority) while the harness runs its tools."""
        warm = EngineRequest(
            request_id=f"{done.request_id}-warm",
            prompt_token_ids=done.prompt_token_ids + generated,
            max_tokens=1,
            priority=tenants.SPECULATIVE_PRIORITY,
            target_replica=done.target_replica,
            cache_salt=done.cache_salt,
        )

        async def run() -> None:
            try:
                async for _ in await self.engines.open(key, warm):
                    pass
            except Exception as e:  # noqa: BLE001 - warming is best effort
                log.debug("speculative prefill failed: %s", e)

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def complete(self, prepared: PreparedRequest) -> list[Event]:
        """The whole stream, minus abandoned calls, which a non-streaming response must not contain. The answer of
        an attempt whose replica was lost midway is dropped: the request ran again (`_LOST_RESTARTS`)."""
        events: list[Event] = []
        async for ev in self.stream(prepared, restartable=True):
            if ev is RESTARTED:
                events.clear()
            else:
                events.append(ev)
        return complete_answer(events)


async def _close(chunks: AsyncIterator[EngineChunk]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:  # noqa: BLE001 - closing a call that already failed
            pass


def engine_lost(e: BaseException) -> bool:
    """Whether `e` says the engine (its replica, or vLLM's engine core) is gone, not that the request was bad."""
    return type(e).__name__ == "EngineDeadError" or replica_gone(e)


def _phases_ms(start: float, marks: dict[str, float]) -> dict[str, float]:
    """Milliseconds each step before the first token took, in order (a step the request never reached is absent)."""
    out, last = {}, start
    for name, t in marks.items():
        out[name] = round((t - last) * 1000, 2)
        last = t
    return out


def _check_logit_bias(bias: dict[int, float] | None, vocab_size: int) -> None:
    """A bias on a token the model does not have is the client's error (vLLM would fail the request later)."""
    for token in bias or {}:
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"logit_bias: token id {token} is not in the model's vocabulary (0..{vocab_size - 1})",
                                 param="logit_bias")


def _engine_constraint(fmt: OutputFormat | None) -> dict | None:
    """vLLM StructuredOutputsParams fields for the requested output format."""
    if fmt is None:
        return None
    return {"json_object": True} if fmt.schema is None else {"json": fmt.schema}


def _classify_engine_error(e: Exception) -> tuple[str, str]:
    name = type(e).__name__
    if name == "BackPressureError":
        return "overloaded", "the engine queue is full, retry shortly"
    if engine_lost(e):
        return "api_error", f"the engine replica failed ({name}); retry the request"
    # vLLM's own request validation (an output schema its grammar cannot compile, ...) is the client's to fix.
    # Across Ray it arrives wrapped; the cause has the message without the remote traceback.
    cause = getattr(e, "cause", None) or e
    if any(c.__name__ == "VLLMClientError" for c in type(cause).__mro__):
        return "invalid_request", (str(cause).strip() or type(cause).__name__)[:1000]
    return "api_error", f"engine error: {name}: {e}"


def _last_input_text(conv: Conversation) -> str:
    """The text of the last user or tool message (what a script rule matches)."""
    for msg in reversed(conv.messages):
        if msg.role in ("user", "tool"):
            out: list[str] = []
            for part in msg.parts:
                if isinstance(part, TextPart):
                    out.append(part.text)
                elif isinstance(part, ToolResultPart):
                    out.append(part.content if isinstance(part.content, str) else " ".join(
                        p.text for p in part.content if isinstance(p, TextPart)))
            return "\n".join(out)
    return ""
