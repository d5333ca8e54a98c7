"""Prometheus metrics of the service: requests, TTFT and inter-token latency, cached-token fraction, router
decisions and queue depth.

Every observation goes to two places:
- a process-local `prometheus_client` registry (`REGISTRY`), served by `GET /metrics` of the ingress replica
  that answers (`serve_app/ingress/metrics_routes.py`) and readable in unit tests without Ray;
- when running inside a Ray worker, the same metric through `ray.util.metrics`, which Ray's metrics agent
  exports on every node (port 8080, `ray_` prefix) so Prometheus sees the sum over all replicas without any
  shared state between them.

Call sites use the small functions below (`observe_ttft(api, seconds)` ...), or wrap a whole event stream with
`instrument_stream(api, events)`, which derives TTFT, inter-token gaps, tokens/s and the cached fraction from the
semantic events and never changes them.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serve_app.conversation import Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart, Usage

PREFIX = "serve_app_"
REGISTRY = CollectorRegistry(auto_describe=True)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 5.0)
FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
RATE_BUCKETS = (1, 5, 10, 20, 40, 80, 160, 320, 640)
# A stream's "first token" is the first event a client can show: reasoning, text or a tool call.
_CONTENT = (ReasoningDelta, TextDelta, ToolCallStart, ToolCallArgsDelta)


class _Metric:
    """One metric in the local registry, mirrored to `ray.util.metrics` when Ray is up in this process."""

    def __init__(self, kind: str, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float] | None = None):
        self.kind, self.name, self.doc, self.labels, self.buckets = kind, name, doc, tuple(labels), buckets
        cls = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[kind]
        extra = {"buckets": buckets} if buckets is not None else {}
        self.local = cls(PREFIX + name, doc, self.labels, registry=REGISTRY, **extra)
        self._ray: Any = None
        self._ray_checked = False
        self._children: dict[tuple, tuple[Any, dict[str, str]]] = {}

    def _ray_metric(self):
        if self._ray_checked:
            return self._ray
        self._ray_checked = True
        try:
            import ray

            if not ray.is_initialized():
                return None
            from ray.util import metrics as rm

            if self.kind == "counter":
                self._ray = rm.Counter(PREFIX + self.name, self.doc, tag_keys=self.labels)
            elif self.kind == "gauge":
                self._ray = rm.Gauge(PREFIX + self.name, self.doc, tag_keys=self.labels)
            else:
                # Ray needs strictly positive, increasing boundaries.
                bounds = [b for b in self.buckets if b > 0]
                self._ray = rm.Histogram(PREFIX + self.name, self.doc, boundaries=bounds, tag_keys=self.labels)
        except Exception:  # noqa: BLE001 - metrics must never break serving
            self._ray = None
        return self._ray

    def record(self, value: float, **labels: str) -> None:
        # Recorded per streamed token (inter-token gaps): the labelled child and the tag dict are looked up once
        # per label set, not built on every call.
        key = tuple(labels.values())
        cached = self._children.get(key)
        if cached is None:
            child = self.local.labels(**labels) if self.labels else self.local
            cached = self._children[key] = (child, {k: str(v) for k, v in labels.items()})
        child, tags = cached
        if self.kind == "counter":
            child.inc(value)
        elif self.kind == "gauge":
            child.set(value)
        else:
            child.observe(value)
        ray_metric = self._ray_metric()
        if ray_metric is not None:
            try:
                if self.kind == "counter":
                    ray_metric.inc(value, tags=tags)
                elif self.kind == "gauge":
                    ray_metric.set(value, tags=tags)
                else:
                    ray_metric.observe(value, tags=tags)
            except Exception:  # noqa: BLE001
                pass


REQUESTS = _Metric("counter", "requests_total", "HTTP requests by API and status code", ("api", "status"))
ERRORS = _Metric("counter", "errors_total", "Errors by API and kind (ServiceError.kind or finish error)", ("api", "kind"))
TTFT = _Metric("histogram", "ttft_seconds", "Time from request arrival to the first content event", ("api",), TTFT_BUCKETS)
ITL = _Metric("histogram", "inter_token_seconds", "Gap between consecutive content events", ("api",), ITL_BUCKETS)
OUTPUT_RATE = _Metric("histogram", "output_tokens_per_second", "Completion tokens / decode time per request",
                      ("api",), RATE_BUCKETS)
CACHED_FRACTION = _Metric("histogram", "cached_token_fraction", "cached_tokens / prompt_tokens per request",
                          ("api",), FRACTION_BUCKETS)
PROMPT_TOKENS = _Metric("counter", "prompt_tokens_total", "Prompt tokens", ("api",))
CACHED_TOKENS = _Metric("counter", "cached_tokens_total", "Prompt tokens served from the prefix cache", ("api",))
COMPLETION_TOKENS = _Metric("counter", "completion_tokens_total", "Completion tokens", ("api",))
FINISHES = _Metric("counter", "finish_total", "Finished generations by finish reason", ("api", "reason"))
ROUTER_DECISIONS = _Metric("counter", "router_decisions_total",
                           "Routing decisions by policy and outcome (e.g. kv_hit, kv_miss, fallback, timeout)",
                           ("policy", "outcome"))
QUEUE_DEPTH = _Metric("gauge", "queue_depth", "Requests waiting or running, by component", ("component",))
INFLIGHT = _Metric("gauge", "inflight_requests", "Requests in flight in this ingress replica", ())
OVERLOAD_REJECTIONS = _Metric("counter", "overload_rejections_total", "Requests answered 429/529 for overload",
                              ("api",))

TENANT_REQUESTS = _Metric("counter", "tenant_requests_total",
                          "Requests admitted or refused by tenant (outcome: admitted or the limit that refused)",
                          ("tenant", "outcome"))


def observe_tenant(tenant: str, outcome: str) -> None:
    TENANT_REQUESTS.record(1, tenant=tenant, outcome=outcome)


def observe_request(api: str, status: int) -> None:
    REQUESTS.record(1, api=api, status=str(status))
    if status in (429, 529):
        OVERLOAD_REJECTIONS.record(1, api=api)


def observe_error(api: str, kind: str) -> None:
    ERRORS.record(1, api=api, kind=kind)


def observe_ttft(api: str, seconds: float) -> None:
    TTFT.record(max(0.0, seconds), api=api)


def observe_inter_token(api: str, seconds: float) -> None:
    ITL.record(max(0.0, seconds), api=api)


def observe_usage(api: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int = 0) -> None:
    PROMPT_TOKENS.record(prompt_tokens, api=api)
    CACHED_TOKENS.record(cached_tokens, api=api)
    COMPLETION_TOKENS.record(completion_tokens, api=api)
    if prompt_tokens > 0:
        CACHED_FRACTION.record(min(1.0, cached_tokens / prompt_tokens), api=api)


def observe_output_rate(api: str, tokens: int, seconds: float) -> None:
    if tokens > 0 and seconds > 0:
        OUTPUT_RATE.record(tokens / seconds, api=api)


def observe_router_decision(policy: str, outcome: str) -> None:
    ROUTER_DECISIONS.record(1, policy=policy, outcome=outcome)


def set_queue_depth(component: str, depth: int) -> None:
    QUEUE_DEPTH.record(depth, component=component)


def set_inflight(n: int) -> None:
    INFLIGHT.record(n)


# The API serving the current request (set by the ingress middleware), so the service can label its metrics.
import contextvars as _cv

CURRENT_API: _cv.ContextVar[str] = _cv.ContextVar("serve_app_api", default="other")


async def instrument_stream(api: str, events: AsyncIterator, started: float | None = None) -> AsyncIterator:
    """Yield `events` unchanged while recording TTFT, inter-token gaps, output rate, usage and the finish reason.

    `started` is the request's arrival time (`time.monotonic()`); it defaults to when iteration starts. Closing
    this generator closes `events` (so a client disconnect still aborts the engine request).
    """
    t0 = started if started is not None else time.monotonic()
    first: float | None = None
    last: float | None = None
    usage: Usage | None = None
    try:
        async for ev in events:
            if isinstance(ev, _CONTENT):
                now = time.monotonic()
                if first is None:
                    first = now
                    observe_ttft(api, now - t0)
                else:
                    observe_inter_token(api, now - last)
                last = now
            elif isinstance(ev, Usage) and not ev.estimated:
                usage = ev
            elif isinstance(ev, Finish):
                FINISHES.record(1, api=api, reason=ev.reason)
                if ev.reason == "error":
                    observe_error(api, getattr(ev, "error_kind", None) or "engine_error")
            yield ev
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
        if usage is not None:
            observe_usage(api, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
            if first is not None and last is not None:
                observe_output_rate(api, usage.completion_tokens, last - first)
