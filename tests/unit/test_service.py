"""GenerationService logic without Ray: limits, routing hand-off, finish mapping, failures, scripts, release.

The engine client here replays chunks in the shape the Engine deployment streams; the real engine path is
covered by the integration tests.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from serve_app.conversation import (
    Conversation, Finish, GenerationOptions, Message, ReasoningDelta, TextDelta, TextPart, ToolCallStart, ToolResultPart,
    Usage,
)
from serve_app.engine.types import EngineChunk
from serve_app.errors import InvalidRequest, ModelNotFound, Overloaded, PromptTooLong
from serve_app.routing.types import Decision
from serve_app.service import GenerationService
from serve_app.settings import AppSettings


@dataclass
class Rendered:
    text: str
    token_ids: list[int]
    starts_in_reasoning: bool = False


class StubTokenizer:
    eos_token_id = 2

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class StubRenderer:
    tokenizer = StubTokenizer()

    def __init__(self, n_tokens):
        self.n = n_tokens

    async def render(self, conv, opts):
        return Rendered("x" * self.n, list(range(self.n)))


class ReplayEngines:
    def __init__(self, chunks=None, fail_after=None, decision=Decision("r1", "kv", cached_blocks=2)):
        self.chunks = chunks or []
        self.fail_after = fail_after
        self.decision = decision
        self.requests = []
        self.routes = []  # the RouteRequests the service asked the Router to place
        self.released = []
        self.prefilled_ids = []
        self.counts = {}  # what the Router is told: the engine's cached tokens and the output generated
        self.closed = False
        self.refuse = None  # an exception open() raises: the engine would not take the request
        self.gate = False  # the engine's reasoning gate (vLLM's reasoning parser holds grammars back)

    async def block_size(self, key):
        return 16

    async def reasoning_gate(self, key):
        return self.gate

    async def choose(self, key, req):
        self.routes.append(req)
        return self.decision

    def release(self, key, request_id, output_tokens=None):
        self.released.append(request_id)
        self.counts["output_tokens"] = output_tokens

    def prefilled(self, key, request_id, cached_tokens=None):
        self.prefilled_ids.append(request_id)
        self.counts["cached_tokens"] = cached_tokens

    async def open(self, key, req):
        if self.refuse is not None:
            raise self.refuse
        self.requests.append(req)
        return self._chunks()

    async def _chunks(self):
        try:
            for i, c in enumerate(self.chunks):
                if self.fail_after is not None and i == self.fail_after:
                    raise RuntimeError("replica died")
                yield c
        finally:
            self.closed = True


def make_service(engines, n_tokens=100, **settings):
    cfg = AppSettings.model_validate({"models": [{"id": "m", "aliases": ["alias"], "max_model_len": 1000,
                                                  "max_output_tokens": 300, "tool_parser": "hermes"}], **settings})
    svc = GenerationService(cfg, engines)
    svc._renderers["m"] = StubRenderer(n_tokens)
    return svc


def conv(text="hi"):
    return Conversation(messages=[Message("user", [TextPart(text)])])


def run(coro):
    return asyncio.run(coro)


async def collect(svc, prepared):
    return [e async for e in svc.stream(prepared)]


def test_unknown_model_and_alias():
    svc = make_service(ReplayEngines())
    with pytest.raises(ModelNotFound) as e:
        run(svc.prepare(conv(), GenerationOptions(), "nope"))
    assert e.value.message == "model: nope" and e.value.status == 404
    assert run(svc.prepare(conv(), GenerationOptions(), "alias")).model.id == "m"


def test_max_tokens_is_clamped_to_what_fits():
    svc = make_service(ReplayEngines(), n_tokens=900)
    p = run(svc.prepare(conv(), GenerationOptions(max_tokens=10**6), "m"))
    assert p.max_tokens == 100  # 1000 context - 900 prompt
    svc = make_service(ReplayEngines(), n_tokens=10)
    assert run(svc.prepare(conv(), GenerationOptions(), "m")).max_tokens == 300  # the model's output cap


@pytest.mark.parametrize("prompt,asked,max_tokens,cut", [
    (900, 10**6, 100, "context_window"),  # asked for more than fits: the context filled first
    (800, None, 200, "context_window"),  # the default (the model's cap) does not fit either
    (900, 50, 50, "length"),  # the client's own max_tokens
    (900, 100, 100, "length"),  # the client's limit and the context's at once: the client got what it asked for
    (10, 10**6, 300, "output_cap"),  # the model's output cap, below what the client asked for
    (10, None, 300, "output_cap"),  # the client set no limit: the cap that stopped it is the deployment's
    (10, 300, 300, "length"),  # the client asked for exactly the cap
    (700, 10**6, 300, "output_cap"),  # the cap and the room left are the same: the cap is what stopped it
])
def test_a_length_stop_says_whose_limit_it_was(prompt, asked, max_tokens, cut):
    """max_tokens is clamped to min(asked, cap, room); a length stop is the context's only when the room left was
    below both the client's max_tokens and the model's cap, and the deployment's cap's when the client set no limit or
    asked for more than the cap (docs/limits.md)."""
    for engine_finish, expected in (("length", cut), ("stop", "stop")):
        svc = make_service(ReplayEngines([EngineChunk("a", [1], finish_reason=engine_finish)]), n_tokens=prompt)
        p = run(svc.prepare(conv(), GenerationOptions(max_tokens=asked), "m"))
        assert p.max_tokens == max_tokens
        assert run(collect(svc, p))[-1] == Finish(expected)


def test_prompt_too_long_names_both_numbers():
    svc = make_service(ReplayEngines(), n_tokens=1200)
    with pytest.raises(PromptTooLong) as e:
        run(svc.prepare(conv(), GenerationOptions(), "m"))
    assert e.value.message == "prompt is too long: 1200 tokens > 1000 maximum"
    assert e.value.openai_message == ("This model's maximum context length is 1000 tokens. However, your messages "
                                      "resulted in 1200 tokens. Please reduce the length of the messages.")


def test_stream_order_usage_and_finish():
    engines = ReplayEngines([EngineChunk("Hel", [1, 2], num_cached_tokens=32), EngineChunk("lo", [3]),
                             EngineChunk("", [4], finish_reason="stop")])
    svc = make_service(engines)
    p = run(svc.prepare(conv(), GenerationOptions(), "m"))
    events = run(collect(svc, p))
    assert events[0] == Usage(100, 0, cached_tokens=32, estimated=True)  # 2 blocks x 16 predicted by the router
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hello"
    assert events[-2] == Usage(100, 4, cached_tokens=32)
    assert events[-1] == Finish("stop")
    assert engines.requests[0].target_replica == "r1"
    assert engines.released == [p.request_id] and engines.prefilled_ids == [p.request_id]
    assert engines.counts == {"cached_tokens": 32, "output_tokens": 4}  # real counts, for the Router's rates


def test_tool_calls_and_stop_sequences_map_to_finish_reasons():
    engines = ReplayEngines([EngineChunk('<tool_call>{"name": "f", "arguments": {}}</tool_call>', [1],
                                         finish_reason="stop")])
    svc = make_service(engines)
    events = run(collect(svc, run(svc.prepare(conv(), GenerationOptions(), "m"))))
    assert any(isinstance(e, ToolCallStart) for e in events) and events[-1].reason == "tool_calls"
    engines = ReplayEngines([EngineChunk("a", [1], finish_reason="stop", stop_reason="END")])
    svc = make_service(engines)
    events = run(collect(svc, run(svc.prepare(conv(), GenerationOptions(stop=["END"]), "m"))))
    assert events[-1] == Finish("stop_sequence", stop_sequence="END")
    engines = ReplayEngines([EngineChunk("a", [1], finish_reason="length")])
    svc = make_service(engines)
    assert run(collect(svc, run(svc.prepare(conv(), GenerationOptions(max_tokens=5), "m"))))[-1].reason == "length"


def test_engine_failure_mid_stream_is_a_finish_error_and_releases():
    engines = ReplayEngines([EngineChunk("a", [1]), EngineChunk("b", [2])], fail_after=1)
    svc = make_service(engines)
    p = run(svc.prepare(conv(), GenerationOptions(), "m"))
    events = run(collect(svc, p))
    assert events[-1].reason == "error" and "replica died" in events[-1].error
    assert engines.released == [p.request_id] and engines.closed
    assert svc._inflight == 0


class ActorDiedError(Exception):  # named like Ray's: the replica (its node) is gone
    pass


class LosingEngines(ReplayEngines):
    """Each attempt replays `answers[i]` and, while `lost_after` has an entry for it, loses its replica after
    that many chunks; records where each attempt was sent."""

    def __init__(self, answers, lost_after, error=ActorDiedError):
        super().__init__()
        self.answers, self.lost_after, self.error = answers, list(lost_after), error
        self.targets = []

    async def open(self, key, req):
        self.targets.append(req.target_replica)
        attempt = len(self.targets) - 1
        return self._attempt(self.answers[min(attempt, len(self.answers) - 1)],
                             self.lost_after[attempt] if attempt < len(self.lost_after) else None)

    async def reopen(self, key, req, lost):  # as ServeEngineClient: away from the lost replica
        assert isinstance(lost, self.error)
        req.target_replica = None
        return await self.open(key, req)

    async def _attempt(self, chunks, lost_after):
        for i, c in enumerate(chunks):
            if i == lost_after:
                raise self.error("the actor died unexpectedly")
            yield c


class LosingLocalEngines(LosingEngines):
    """The engines in this process (LocalEngineClient): no other replica to hand a request to."""

    reopen = None


class NoLiveReplica(LosingEngines):
    async def reopen(self, key, req, lost):  # the only replica was lost: the client gives up at once
        self.targets.append("gave up")
        raise lost


LOST_FIRST = [EngineChunk("<think>", [1]), EngineChunk("half an ans", [2, 3]), EngineChunk("wer", [4])]
WHOLE = [EngineChunk("The whole ", [5, 6]), EngineChunk('answer.<tool_call>{"name": "f", "arguments": {"a": 1}}',
                                                        [7, 8]), EngineChunk("</tool_call>", [9], finish_reason="stop")]


def test_a_non_streamed_request_whose_replica_is_lost_midway_runs_again():
    """Nothing of a non-streamed answer has reached the client when its replica is lost: the request starts
    again on a live replica and the client gets one whole answer, with only the new attempt's events."""
    engines = LosingEngines([LOST_FIRST, WHOLE], lost_after=[2])
    svc = make_service(engines)
    p = run(svc.prepare(conv(), GenerationOptions(), "m"))
    events = run(svc.complete(p))
    assert engines.targets == ["r1", None]  # the Router's choice first, then wherever Serve finds a live replica
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "The whole answer."
    assert not any(isinstance(e, ReasoningDelta) for e in events)  # the lost attempt's parser state is gone too
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["f"]
    assert [e for e in events if isinstance(e, Usage) and not e.estimated] == [Usage(100, 5, cached_tokens=0)]
    assert events[-1] == Finish("tool_calls")
    assert engines.released == [p.request_id] and svc._inflight == 0


def test_a_streamed_request_whose_replica_is_lost_midway_fails_in_stream():
    """A streamed answer's deltas are already with the client: no second attempt, an error event."""
    engines = LosingEngines([LOST_FIRST, WHOLE], lost_after=[2])
    svc = make_service(engines)
    events = run(collect(svc, run(svc.prepare(conv(), GenerationOptions(), "m"))))
    assert engines.targets == ["r1"]
    assert events[-1].reason == "error" and "the engine replica failed (ActorDiedError)" in events[-1].error


@pytest.mark.parametrize("engines_class,opened", [(LosingLocalEngines, ["r1"]), (NoLiveReplica, ["r1", "gave up"])])
def test_a_non_streamed_request_fails_with_its_loss_when_no_replica_can_take_it(engines_class, opened):
    engines = engines_class([LOST_FIRST, WHOLE], lost_after=[2])
    svc = make_service(engines)
    p = run(svc.prepare(conv(), GenerationOptions(), "m"))
    events = run(svc.complete(p))
    assert engines.targets == opened
    assert events[-1].reason == "error" and "the engine replica failed (ActorDiedError)" in events[-1].error
    assert engines.released == [p.request_id] and svc._inflight == 0


@pytest.mark.parametrize("lost_after,error,opened", [
    ([1, 0, 2], ActorDiedError, 3),  # lost on every attempt: two restarts, then the error
    ([1], RuntimeError, 1),  # the request failed, not its replica: running it again would fail again
])
def test_a_non_streamed_request_restarts_only_for_a_lost_replica_and_only_twice(lost_after, error, opened):
    engines = LosingEngines([LOST_FIRST], lost_after=lost_after, error=error)
    svc = make_service(engines)
    p = run(svc.prepare(conv(), GenerationOptions(), "m"))
    events = run(svc.complete(p))
    assert len(engines.targets) == opened
    assert events[-1].reason == "error" and events[-1].error_kind == "api_error"
    assert engines.released == [p.request_id] and svc._inflight == 0


def test_an_engine_that_refuses_fails_before_any_output_and_releases():
    class BackPressureError(Exception):  # named like Serve's: classified as overload by its name
        pass

    engines = ReplayEngines([EngineChunk("a", [1], finish_reason="stop")])
    engines.refuse = BackPressureError("queue full")
    svc = make_service(engines)
    p = run(svc.prepare(conv(), GenerationOptions(), "m"))
    events = run(collect(svc, p))
    # Nothing before the Finish, so a route that peeks the first event can still answer 529.
    assert len(events) == 1 and events[0].reason == "error" and events[0].error_kind == "overloaded"
    assert engines.released == [p.request_id] and svc._inflight == 0


def test_a_request_for_an_engine_being_replaced_is_refused_with_retry_after_before_any_output():
    """engine_placement: ingress: the engine's core died and LocalEngineClient is replacing it. The request gets
    only the refusal, so the route answers 503 (Anthropic: 529) with the replacement's retry-after."""
    import threading

    from serve_app.engine.local_client import RESTARTING_RETRY_AFTER_S, LocalEngineClient
    from serve_app.ingress.sse import finish_error
    from serve_app.service import engine_key

    class Dead:
        block_size, reasoning_gate, dead = 16, False, True

        def shutdown(self):
            pass

    go = threading.Event()

    def restart(key, dead):
        go.wait(20)
        return Dead()

    cfg_models = make_service(ReplayEngines()).settings.models
    svc = make_service(LocalEngineClient({engine_key(cfg_models[0]): Dead()}, restart=restart))
    p = run(svc.prepare(conv(), GenerationOptions(), "m"))

    async def refused():
        try:
            return await collect(svc, p)
        finally:
            go.set()

    events = run(refused())
    assert len(events) == 1 and events[0].reason == "error" and events[0].error_kind == "overloaded"
    assert "restarting" in events[0].error and events[0].retry_after == RESTARTING_RETRY_AFTER_S
    err = finish_error(events[0])
    assert isinstance(err, Overloaded) and err.retry_after == RESTARTING_RETRY_AFTER_S and svc._inflight == 0


def test_router_unavailable_still_serves():
    engines = ReplayEngines([EngineChunk("ok", [1], finish_reason="stop")], decision=None)
    svc = make_service(engines)
    events = run(collect(svc, run(svc.prepare(conv(), GenerationOptions(), "m"))))
    assert events[0].cached_tokens == 0 and events[-1] == Finish("stop")
    assert engines.requests[0].target_replica is None and engines.released == []


def test_closing_the_stream_closes_the_engine_call():
    engines = ReplayEngines([EngineChunk("a", [1])] * 100)
    svc = make_service(engines)
    p = run(svc.prepare(conv(), GenerationOptions(), "m"))

    async def take_two():
        it = svc.stream(p)
        got = [await it.__anext__(), await it.__anext__()]
        await it.aclose()
        return got

    run(take_two())
    assert engines.closed and engines.released == [p.request_id] and svc._inflight == 0


def test_forced_scripts_only_when_enabled_and_rules_match_the_last_input():
    engines = ReplayEngines([EngineChunk("", [1], finish_reason="stop")])
    svc = make_service(engines)
    run(collect(svc, run(svc.prepare(conv(), GenerationOptions(forced_script="x"), "m"))))
    assert engines.requests[-1].forced_token_ids is None  # testing.forced_scripts is off
    svc = make_service(engines, testing={"forced_scripts": True,
                                         "script_rules": [{"match": "^echo hi$", "script": "no", "model": "x"},
                                                          {"match": "^echo hi$", "script": "done"}]})
    tool_turn = Conversation(messages=[Message("user", [TextPart("run it")]),
                                       Message("tool", [ToolResultPart("c1", "echo hi")])])
    run(collect(svc, run(svc.prepare(tool_turn, GenerationOptions(), "m"))))
    assert engines.requests[-1].forced_token_ids == [ord(c) for c in "done"]
    assert engines.requests[-1].forced_eos_id == 2
    run(collect(svc, run(svc.prepare(conv("other"), GenerationOptions(), "m"))))
    assert engines.requests[-1].forced_token_ids is None


def test_overload_is_refused_at_once_and_admission_counts_from_prepare():
    engines = ReplayEngines([EngineChunk("", [1], finish_reason="stop")])
    svc = make_service(engines, ingress={"max_inflight_requests": 2})
    first = run(svc.prepare(conv(), GenerationOptions(), "m"))
    second = run(svc.prepare(conv(), GenerationOptions(), "m"))  # neither has started streaming yet
    with pytest.raises(Overloaded) as e:
        run(svc.prepare(conv(), GenerationOptions(), "m"))
    assert e.value.kind == "overloaded" and e.value.retry_after
    run(collect(svc, first))  # finishing one frees its slot
    assert svc._inflight == 1
    del second  # an adapter that gave up before streaming frees its slot too
    import gc

    gc.collect()
    assert svc._inflight == 0


class SlowRenderer(StubRenderer):
    """Yields to the event loop while rendering, as the real renderer's worker thread does."""

    async def render(self, conv, opts):
        await asyncio.sleep(0.01)
        return await super().render(conv, opts)


def test_a_concurrent_burst_cannot_slip_past_the_admission_limit():
    svc = make_service(ReplayEngines(), ingress={"max_inflight_requests": 3})
    svc._renderers["m"] = SlowRenderer(100)

    async def burst():
        return await asyncio.gather(*(svc.prepare(conv(), GenerationOptions(), "m") for _ in range(10)),
                                    return_exceptions=True)

    results = run(burst())
    admitted = [r for r in results if not isinstance(r, Exception)]
    assert len(admitted) == 3 and svc._inflight == 3
    assert all(isinstance(r, Overloaded) for r in results if isinstance(r, Exception))


def test_a_request_refused_after_admission_frees_its_slot():
    svc = make_service(ReplayEngines(), n_tokens=5000, ingress={"max_inflight_requests": 1})
    with pytest.raises(PromptTooLong):
        run(svc.prepare(conv(), GenerationOptions(), "m"))
    assert svc._inflight == 0


def test_zero_max_tokens_is_invalid():
    svc = make_service(ReplayEngines())
    with pytest.raises(InvalidRequest):
        run(svc.prepare(conv(), GenerationOptions(max_tokens=0), "m"))


def test_hints_reach_the_engine_request():
    from serve_app.conversation import AgentHints

    engines = ReplayEngines([EngineChunk("", [1], finish_reason="stop")])
    svc = make_service(engines)
    opts = GenerationOptions(hints=AgentHints(priority=5, osl=77))
    run(collect(svc, run(svc.prepare(conv(), opts, "m"))))
    assert engines.requests[-1].priority == -5  # vLLM runs lower values first


def test_osl_hint_is_the_routers_expected_output():
    """`agent_hints.osl` is what the Router reserves as the request's decode load on the chosen replica."""
    from serve_app.conversation import AgentHints

    engines = ReplayEngines([EngineChunk("", [1], finish_reason="stop")])
    svc = make_service(engines)
    run(collect(svc, run(svc.prepare(conv(), GenerationOptions(hints=AgentHints(osl=1234)), "m"))))
    run(collect(svc, run(svc.prepare(conv(), GenerationOptions(max_tokens=40), "m"))))
    run(collect(svc, run(svc.prepare(conv(), GenerationOptions(), "m"))))
    # Without the hint: the request's own output cap (40; the model's 300 when unset).
    assert [r.expected_output_tokens for r in engines.routes] == [1234, 40, 300]
    assert all(r.num_prompt_tokens == 100 for r in engines.routes)


def test_osl_from_the_wire_reaches_the_router():
    from serve_app.ingress.chat.convert import chat_request_to_conversation

    engines = ReplayEngines([EngineChunk("", [1], finish_reason="stop")])
    svc = make_service(engines)
    _, c, opts = chat_request_to_conversation({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "nvext": {"agent_hints": {"osl": 77}}})
    run(collect(svc, run(svc.prepare(c, opts, "m"))))
    assert engines.routes[-1].expected_output_tokens == 77


class RoutedEngines(ReplayEngines):
    """Engines placed by a real RouterCore; nothing is reported back, so every request stays in flight."""

    def __init__(self, policy: str):
        from serve_app.routing.core import RouterCore

        super().__init__([EngineChunk("", [1], finish_reason="stop")])
        self.core = RouterCore(policy, 16, seed=1)
        self.core.sync_replicas(["r1", "r2"])
        self.placed = []

    async def choose(self, key, req):
        decision = self.core.choose(req)
        self.placed.append(decision.replica_id)
        return decision

    def prefilled(self, key, request_id, cached_tokens=None):
        pass

    def release(self, key, request_id, output_tokens=None):
        pass


def test_osl_changes_where_the_router_places_the_next_request():
    """Behaviour, not only plumbing: with two requests in flight, one announcing a long answer (osl 2000, though
    its max_tokens is only 50) and one a one-token answer (max_tokens 250), the next request goes beside the short
    one. Were `osl` ignored, the caps (50 vs 250) would stand in and it would go beside the first."""
    from serve_app.conversation import AgentHints

    engines = RoutedEngines("least_loaded")
    svc = make_service(engines)
    for opts in (GenerationOptions(max_tokens=50, hints=AgentHints(osl=2000)),
                 GenerationOptions(max_tokens=250, hints=AgentHints(osl=1)),
                 GenerationOptions()):
        run(collect(svc, run(svc.prepare(conv(), opts, "m"))))
    long_answer, short_answer, nxt = engines.placed
    assert long_answer != short_answer
    assert nxt == short_answer
    loads = engines.core.loads
    assert loads[long_answer].active_decode_tokens == 2000 and loads[short_answer].active_decode_tokens == 1 + 300


async def collect_and_settle(svc, prepared):
    """The stream's events, then whatever the service started in the background once it finished."""
    events = await collect(svc, prepared)
    await asyncio.gather(*list(svc._background))
    return events


def _speculative(**hints):
    from serve_app.ingress.chat.convert import chat_request_to_conversation

    _, c, opts = chat_request_to_conversation({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "nvext": {"agent_hints": hints}})
    return c, opts


def test_speculative_prefill_warms_prompt_plus_answer_on_the_same_replica():
    engines = ReplayEngines([EngineChunk("Hel", [7, 8]), EngineChunk("lo", [9]),
                             EngineChunk("", [10], finish_reason="stop")],
                            decision=Decision("r2", "kv", cached_blocks=0))
    svc = make_service(engines)
    c, opts = _speculative(speculative_prefill=True, priority=3)
    p = run(svc.prepare(c, opts, "m"))
    events = run(collect_and_settle(svc, p))
    assert events[-1] == Finish("stop")
    main, warm = engines.requests  # a second engine request, after the turn
    assert warm.request_id != main.request_id
    # The next turn's prefix: this prompt followed by every token this turn generated.
    assert warm.prompt_token_ids == list(range(100)) + [7, 8, 9, 10]
    assert warm.max_tokens == 1
    assert warm.target_replica == main.target_replica == "r2"  # where this turn's KV already is
    assert warm.priority > main.priority  # vLLM runs lower values first: the warm-up yields to real requests
    assert warm.priority > 100_000  # to every real request: the lowest tier's, with the lowest hint, included
    assert len(engines.routes) == 1  # not routed, so not counted as a request by the Router
    assert engines.released == [p.request_id]


def test_no_speculative_prefill_without_the_hint_or_after_a_failed_turn():
    engines = ReplayEngines([EngineChunk("a", [1]), EngineChunk("", [2], finish_reason="stop")])
    svc = make_service(engines)
    c, opts = _speculative(speculative_prefill=False)
    run(collect_and_settle(svc, run(svc.prepare(c, opts, "m"))))
    assert len(engines.requests) == 1
    failing = ReplayEngines([EngineChunk("a", [1]), EngineChunk("b", [2])], fail_after=1)
    svc = make_service(failing)
    c, opts = _speculative(speculative_prefill=True)
    events = run(collect_and_settle(svc, run(svc.prepare(c, opts, "m"))))
    assert events[-1].reason == "error" and len(failing.requests) == 1


def _wire_to_ir(api: str, hints: dict):
    """(Conversation, GenerationOptions) of a minimal request of `api` carrying `nvext.agent_hints`."""
    nvext = {"agent_hints": hints}
    if api == "chat":
        from serve_app.ingress.chat.convert import chat_request_to_conversation

        _, c, opts = chat_request_to_conversation({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "nvext": nvext})
        return c, opts
    if api == "anthropic":
        from serve_app.ingress.anthropic.convert import messages_request, to_conversation

        return to_conversation(messages_request({"model": "m", "max_tokens": 200, "nvext": nvext,
                                                 "messages": [{"role": "user", "content": "hi"}]}), b"s")
    from serve_app.ingress.responses.convert import parse_responses_request, responses_to_conversation

    return responses_to_conversation(parse_responses_request({"model": "m", "input": "hi", "nvext": nvext}))


@pytest.mark.parametrize("api", ["chat", "anthropic", "responses"])
def test_agent_hints_act_on_every_api(api):
    """`nvext.agent_hints` from each API's wire body: `osl` is the Router's expected output, `speculative_prefill`
    warms the next turn on the same replica, `priority` orders the engine's queue."""
    engines = ReplayEngines([EngineChunk("a", [5]), EngineChunk("", [6], finish_reason="stop")],
                            decision=Decision("r2", "kv", cached_blocks=0))
    svc = make_service(engines)
    c, opts = _wire_to_ir(api, {"osl": 700, "speculative_prefill": True, "priority": 2})
    run(collect_and_settle(svc, run(svc.prepare(c, opts, "m"))))
    assert [r.expected_output_tokens for r in engines.routes] == [700]
    main, warm = engines.requests
    assert main.priority == -2 and warm.max_tokens == 1 and warm.target_replica == "r2"
    assert warm.prompt_token_ids == main.prompt_token_ids + [5, 6]


class ProbedEngines(ReplayEngines):
    """Engines whose probe answers, fails or hangs, by engine key."""

    def __init__(self, behaviour: dict[str, str]):
        super().__init__()
        self.behaviour = behaviour

    async def probe(self, key):
        how = self.behaviour[key]
        if how == "fail":
            raise RuntimeError("replica died")
        if how == "hang":
            await asyncio.sleep(3600)


def test_readiness_names_each_engine_that_does_not_answer():
    from serve_app.service import engine_key

    cfg = {"models": [{"id": "a"}, {"id": "a2", "source": "a"},
                      {"id": "b", "max_model_len": 16384}, {"id": "c", "max_model_len": 32768}]}
    settings = AppSettings.model_validate(cfg)
    ka, kb, kc = (engine_key(settings.find_model(m)) for m in ("a", "b", "c"))
    assert engine_key(settings.find_model("a2")) == ka  # same weights and settings: one engine, probed once
    svc = GenerationService(settings, ProbedEngines({ka: "ok", kb: "fail", kc: "hang"}))
    report = run(svc.readiness(timeout_s=0.05))
    assert report[ka] is None and len(report) == 3
    assert "RuntimeError: replica died" in report[kb] and "no answer within 0.05 s" in report[kc]
    svc_ok = GenerationService(settings, ProbedEngines({ka: "ok", kb: "ok", kc: "ok"}))
    assert run(svc_ok.readiness(timeout_s=0.05)) == {ka: None, kb: None, kc: None}


def test_health_is_200_only_when_every_engine_answers():
    """`/health` (and `/health/ready`) is readiness: what a newcomer polls before the first request must not say
    ok while an engine is still starting. `/health/live` answers whatever the engines do."""
    import httpx
    from fastapi import FastAPI

    from serve_app.ingress import models_routes
    from serve_app.ingress.context import IngressContext
    from serve_app.service import engine_key

    settings = AppSettings.model_validate({"models": [{"id": "a"}, {"id": "b", "max_model_len": 16384}]})
    ka, kb = engine_key(settings.models[0]), engine_key(settings.models[1])

    async def get(behaviour):
        app = FastAPI()
        app.state.ctx = IngressContext(settings=settings, service=GenerationService(settings, ProbedEngines(behaviour)),
                                       secret=b"s")
        app.include_router(models_routes.router)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
            return [await c.get(path) for path in ("/health", "/health/ready", "/health/live")]

    health, ready, live = run(get({ka: "ok", kb: "ok"}))
    for r in (health, ready):
        assert r.status_code == 200 and r.json() == {"status": "ready", "engines": {ka: "ok", kb: "ok"}}
    health, ready, live = run(get({ka: "ok", kb: "fail"}))
    for r in (health, ready):
        assert r.status_code == 503 and r.json()["status"] == "not_ready"
        assert r.json()["engines"][ka] == "ok" and "replica died" in r.json()["engines"][kb]
    assert live.status_code == 200 and live.json()["status"] == "ok"  # liveness does not depend on the engines


class PromptStateRenderer(StubRenderer):
    """A renderer whose prompt leaves the think block open or not."""

    def __init__(self, n_tokens, opens_think):
        super().__init__(n_tokens)
        self.opens_think = opens_think

    async def render(self, conv, opts):
        return Rendered("x" * self.n, list(range(self.n)), starts_in_reasoning=self.opens_think)


@pytest.mark.parametrize("reasoning,opens_think", [("deepseek_r1", False), ("qwen3", True), ("kimi_k2", True),
                                                   ("glm47", True), ("deepseek_v4", True)])
def test_the_rendered_prompt_decides_where_the_output_starts(reasoning, opens_think):
    """Where the output starts (inside reasoning or not) is what the rendered prompt says, whatever the reasoning
    format would assume: an R1-style format after a prompt that closed the block starts in text, a qwen3/kimi/
    glm47/deepseek_v4 template that opened it starts in reasoning."""
    engines = ReplayEngines([EngineChunk("plan", [1]), EngineChunk("", [2], finish_reason="stop")])
    cfg = AppSettings.model_validate({"models": [{"id": "m", "max_model_len": 1000, "max_output_tokens": 300,
                                                  "reasoning_parser": reasoning}]})
    svc = GenerationService(cfg, engines)
    svc._renderers["m"] = PromptStateRenderer(10, opens_think)
    p = run(svc.prepare(conv(), GenerationOptions(), "m"))
    assert p.starts_in_reasoning is opens_think
    events = run(collect(svc, p))
    kinds = {type(e).__name__ for e in events if isinstance(e, (TextDelta, ReasoningDelta))}
    assert kinds == ({"ReasoningDelta"} if opens_think else {"TextDelta"})


def _tools_conv(choice, *, tools=("get_weather",)):
    from serve_app.conversation import ToolSpec

    return Conversation(messages=[Message("user", [TextPart("hi")])],
                        tools=[ToolSpec(n, parameters={"type": "object", "properties": {"city": {"type": "string"}}})
                               for n in tools],
                        tool_choice=choice)


def test_tool_choice_reaches_the_engine_as_a_grammar_in_the_models_format():
    import json

    from serve_app.conversation import OutputFormat, ToolChoice

    def engine_req(choice, opts=None, **settings):
        engines = ReplayEngines([EngineChunk("a", [1], finish_reason="stop")])
        svc = make_service(engines, **settings)
        run(collect(svc, run(svc.prepare(_tools_conv(choice), opts or GenerationOptions(), "m"))))
        return engines.requests[0]

    forced = engine_req(ToolChoice("tool", name="get_weather"))
    tag = json.loads(forced.structured["structural_tag"])
    assert [t["begin"] for t in tag["format"]["tags"]] == ['<tool_call>\n{"name": "get_weather", "arguments": ']
    assert engine_req(ToolChoice("auto")).structured is None  # auto with parallel calls: the model is free
    assert "structural_tag" in engine_req(ToolChoice("auto", parallel=False)).structured
    assert "structural_tag" in engine_req(ToolChoice("none")).structured
    # a forced choice wins over an output format; otherwise the output format stays
    schema = {"type": "object"}
    assert "structural_tag" in engine_req(ToolChoice("required"), GenerationOptions(output_format=OutputFormat(schema))).structured
    assert engine_req(ToolChoice("none"), GenerationOptions(output_format=OutputFormat(schema))).structured == {"json": schema}
    # a forced script is exact text: no grammar fights it
    script = engine_req(ToolChoice("required"), GenerationOptions(forced_script="x"), testing={"forced_scripts": True})
    assert script.structured is None and script.forced_token_ids


def test_a_tool_choice_that_names_no_given_tool_is_a_400():
    from serve_app.conversation import ToolChoice

    svc = make_service(ReplayEngines())
    with pytest.raises(InvalidRequest) as e:
        run(svc.prepare(_tools_conv(ToolChoice("tool", name="nope")), GenerationOptions(), "m"))
    assert "'nope'" in e.value.message and e.value.param == "tool_choice"
    with pytest.raises(InvalidRequest):
        run(svc.prepare(_tools_conv(ToolChoice("required"), tools=()), GenerationOptions(), "m"))


def test_sampling_penalties_and_token_biases_reach_vllms_sampling_params():
    from types import SimpleNamespace

    from serve_app.engine.vllm_engine import VLLMEngine

    engines = ReplayEngines([EngineChunk("", [1], finish_reason="stop")])
    svc = make_service(engines)
    opts = GenerationOptions(frequency_penalty=0.5, presence_penalty=-0.25, logit_bias={7: -100.0})
    svc._renderers["m"].vocab_size = 100
    run(collect(svc, run(svc.prepare(conv(), opts, "m"))))
    req = engines.requests[-1]
    assert (req.frequency_penalty, req.presence_penalty, req.logit_bias) == (0.5, -0.25, {7: -100.0})
    params = VLLMEngine.sampling_params(SimpleNamespace(forced_scripts=False, default_sampling={}), req)
    assert (params.frequency_penalty, params.presence_penalty, params.logit_bias) == (0.5, -0.25, {7: -100.0})
    with pytest.raises(InvalidRequest) as e:  # a token the model does not have is the client's error
        run(svc.prepare(conv(), GenerationOptions(logit_bias={100: 1.0}), "m"))
    assert e.value.param == "logit_bias" and "not in the model's vocabulary" in e.value.message
