"""Prometheus metrics of the service: requests, TTFT and inter-token latency, cached-token fraction, router
decisions and queue depth.

One registry per process, never two copies of an observation:
- in a Ray worker (every Serve replica) each metric is a `ray.util.metrics` metric. Ray's metrics agent on each
  node exports it with a `ray_` prefix on the node's metrics export port (8080 on KubeRay), beside Ray Serve's own
  metrics and vLLM's engine metrics (the Engine replica gives AsyncLLM vLLM's Ray stat logger), so one scrape of
  every node's port sees all replicas, summed by Prometheus, with no shared state between them;
- in any other process (unit tests, a driver script, a tool) each metric lives in the process-local
  `prometheus_client` registry `REGISTRY`, readable without Ray.
`GET /metrics` (`serve_app/ingress/metrics_routes.py`) shows whichever of the two this process records into: in a
replica, the exposition of its node's metrics agent. docs/operations.md says what to scrape where.

Call sites use the small functions below (`observe_ttft(api, seconds)` ...), or wrap a whole event stream with
`instrument_stream(api, events)`, which derives TTFT, inter-token gaps, tokens/s and the cached fraction from the
semantic events and never changes them.
"""

from __future__ import annotations

import threading
import time
from typing import Any, AsyncIterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serve_app.conversation import Finish, ReasoningDelta, TextDelta, ToolCallArgsDelta, ToolCallStart, Usage

PREFIX = "serve_app_"
# Ray's metrics agent prefixes every application metric with this on export.
RAY_EXPORT_PREFIX = "ray_"
REGISTRY = CollectorRegistry(auto_describe=True)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 5.0)
FRACTION_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
RATE_BUCKETS = (1, 5, 10, 20, 40, 80, 160, 320, 640)
# A stream's "first token" is the first event a client can show: reasoning, text or a tool call.
_CONTENT = (ReasoningDelta, TextDelta, ToolCallStart, ToolCallArgsDelta)


def in_ray_worker() -> bool:
    """True in a process Ray started to run tasks or actors (a Serve replica), not in a driver or a test."""
    try:
        import ray
        from ray._private import worker as ray_worker

        return ray.is_initialized() and ray_worker.global_worker.mode == ray_worker.WORKER_MODE
    except Exception:  # noqa: BLE001 - no Ray, or a Ray without these internals: record locally
        return False


REPLICA_LABEL = "replica"


def _replica_id() -> str:
    """This process's Serve replica id (the one the router and vLLM's `ReplicaId` use), else its Ray worker id."""
    import ray

    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not a Serve replica (a Ray task or actor of a benchmark)
        return ray.get_runtime_context().get_worker_id()


class _Metric:
    """One metric; it records into Ray's metrics in a Ray worker and into `REGISTRY` everywhere else.

    The backend is chosen at the first observation, when the process's role is known: module import happens before
    Ray connects a replica's process. The local collector is registered only then too, so a replica's `REGISTRY`
    stays empty rather than holding zero-valued copies.
    """

    def __init__(self, kind: str, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float] | None = None):
        self.kind, self.name, self.doc, self.labels, self.buckets = kind, name, doc, tuple(labels), buckets
        self._local: Any = None
        self._ray: Any = None
        self._chosen = False
        self._lock = threading.Lock()  # first observations may race between the loop and tokenizer threads
        # label values -> a bound recorder (the labelled child's method, or Ray's method with its tag dict)
        self._children: dict[tuple, Any] = {}

    def _choose(self) -> None:
        self._chosen = True
        if in_ray_worker():
            try:
                self._ray = self._make_ray()
                return
            except Exception:  # noqa: BLE001 - metrics must never break serving; fall back to the local registry
                self._ray = None
        cls = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[self.kind]
        extra = {"buckets": self.buckets} if self.buckets is not None else {}
        self._local = cls(PREFIX + self.name, self.doc, self.labels, registry=REGISTRY, **extra)

    @property
    def exported_labels(self) -> tuple[str, ...]:
        """The labels of this metric as Ray's agent exports it (beside Ray's own: SessionName, NodeAddress...).

        A gauge is one value per process, and the agent drops Ray's per-worker label and keeps one value per
        remaining label set, so each replica's gauge carries its replica id (`replica`, as Ray Serve's metrics
        do); counters and histograms are summed across processes, as Prometheus would."""
        return self.labels + (REPLICA_LABEL,) if self.kind == "gauge" else self.labels

    def _make_ray(self):
        from ray.util import metrics as rm

        if self.kind == "counter":
            return rm.Counter(PREFIX + self.name, self.doc, tag_keys=self.labels)
        if self.kind == "gauge":
            gauge = rm.Gauge(PREFIX + self.name, self.doc, tag_keys=self.exported_labels)
            gauge.set_default_tags({REPLICA_LABEL: _replica_id()})
            return gauge
        # Ray needs strictly positive, increasing boundaries.
        bounds = [b for b in self.buckets if b > 0]
        return rm.Histogram(PREFIX + self.name, self.doc, boundaries=bounds, tag_keys=self.labels)

    def _recorder(self, key: tuple, labels: dict[str, str]):
        if self._ray is not None:
            method = {"counter": "inc", "gauge": "set", "histogram": "observe"}[self.kind]
            fn, tags = getattr(self._ray, method), {k: str(v) for k, v in labels.items()}
            if self.kind == "gauge":
                return _BUFFERED.recorder(fn, tags)
            if self.kind == "counter":  # a zero increment is dropped there (Ray's counters refuse it)
                return _BUFFERED.counter(fn, tags)

            def record(value: float) -> None:
                try:
                    fn(value, tags=tags)
                except Exception:  # noqa: BLE001 - metrics must never break serving
                    pass

            return record
        child = self._local.labels(**labels) if self.labels else self._local
        return getattr(child, {"counter": "inc", "gauge": "set", "histogram": "observe"}[self.kind])

    def record(self, value: float, **labels: str) -> None:
        # Recorded per streamed token (inter-token gaps): the bound recorder and its tag dict are built once per
        # label set, not on every call.
        key = tuple(labels.values())
        fn = self._children.get(key)
        if fn is None:
            with self._lock:
                if not self._chosen:
                    self._choose()
                fn = self._children[key] = self._recorder(key, labels)
        fn(value)


class _Flusher:
    """Ray-backed gauges and counters hand Ray their latest value / accumulated increments at most every
    `PERIOD_S`, from one daemon thread.

    Why: a metric is only read when Ray's agent exports (every few seconds), but the ingress sets its in-flight and
    queue gauges twice per request and vLLM's stat logger sets about ten gauges and counters on every engine step
    (at low concurrency, every token), and each `ray.util.metrics` call is a call into Ray's core worker: together
    about a tenth of the ingress's busy time at concurrency 1 (docs/serving-path.md). Recording is now a dict store
    (a gauge) or an addition under an uncontended lock (a counter); what Ray exports is at most `PERIOD_S` old.
    Histograms are not buffered: Ray has no call that records several observations at once, so buffering would only
    move the cost to this thread."""

    PERIOD_S = 0.5

    def __init__(self):
        self._latest: dict[int, tuple[Any, dict[str, str], float]] = {}
        self._sent: dict[int, tuple] = {}
        self._pending: list[list] = []  # counters with increments not yet sent: [fn, tags, sum]
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def recorder(self, fn, tags: dict[str, str]):
        """A gauge's setter: `fn(value, tags=tags)` is called with the latest value at the next flush."""
        slot = id(tags)  # one slot per (gauge, label set): the tag dict is built once per label set

        def record(value: float) -> None:
            self._latest[slot] = (fn, tags, value)
            if self._thread is None:
                self._start()

        return record

    def counter(self, fn, tags: dict[str, str]):
        """A counter's increment: `fn(sum, tags=tags)` is called at the next flush with what was added since the
        last one (nothing when that is zero: Ray's counters refuse a zero increment)."""
        entry = [fn, tags, 0.0]

        def inc(value: float = 1.0) -> None:
            if value <= 0:
                return
            with self._pending_lock:
                if entry[2] == 0:
                    self._pending.append(entry)
                entry[2] += value
            if self._thread is None:
                self._start()

        return inc

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="serve-app-metrics", daemon=True)
                self._thread.start()

    def flush(self) -> None:
        # The dict always holds each gauge's latest value (a store races with nothing); only changes are sent.
        for slot, entry in list(self._latest.items()):
            if self._sent.get(slot) is entry:
                continue
            fn, tags, value = entry
            try:
                fn(value, tags=tags)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                pass
            self._sent[slot] = entry
        with self._pending_lock:
            due = [(e[0], e[1], e[2]) for e in self._pending]
            for e in self._pending:
                e[2] = 0.0
            self._pending.clear()
        for fn, tags, total in due:
            try:
                fn(total, tags=tags)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                pass

    def _run(self) -> None:
        while True:
            time.sleep(self.PERIOD_S)
            self.flush()


_BUFFERED = _Flusher()


REQUESTS = _Metric("counter", "requests_total", "HTTP requests by API, status code and tenant ('none' before auth)",
                   ("api", "status", "tenant"))
ERRORS = _Metric("counter", "errors_total", "Errors by API and kind (ServiceError.kind or finish error)", ("api", "kind"))
TTFT = _Metric("histogram", "ttft_seconds", "Time from request arrival to the first content event", ("api",), TTFT_BUCKETS)
ITL = _Metric("histogram", "inter_token_seconds", "Gap between consecutive content events", ("api",), ITL_BUCKETS)
OUTPUT_RATE = _Metric("histogram", "output_tokens_per_second", "Completion tokens / decode time per request",
                      ("api",), RATE_BUCKETS)
CACHED_FRACTION = _Metric("histogram", "cached_token_fraction", "cached_tokens / prompt_tokens per request",
                          ("api",), FRACTION_BUCKETS)
# By tenant too: a team sharing the service sees who uses its capacity (tenants are configured, so few values).
PROMPT_TOKENS = _Metric("counter", "prompt_tokens_total", "Prompt tokens", ("api", "tenant"))
CACHED_TOKENS = _Metric("counter", "cached_tokens_total", "Prompt tokens served from the prefix cache",
                        ("api", "tenant"))
COMPLETION_TOKENS = _Metric("counter", "completion_tokens_total", "Completion tokens", ("api", "tenant"))
FINISHES = _Metric("counter", "finish_total", "Finished generations by finish reason", ("api", "reason"))
ROUTER_DECISIONS = _Metric("counter", "router_decisions_total",
                           "Routing decisions by policy and outcome (e.g. kv_hit, kv_miss, fallback, timeout)",
                           ("policy", "outcome"))
QUEUE_DEPTH = _Metric("gauge", "queue_depth", "Requests waiting or running, by component", ("component",))
INFLIGHT = _Metric("gauge", "inflight_requests", "Requests in flight in this ingress replica", ())
OVERLOAD_REJECTIONS = _Metric("counter", "overload_rejections_total",
                              "Requests answered 429/503/529 for overload (503: the OpenAI APIs' overload)",
                              ("api",))

ENGINE_RESTARTS = _Metric("counter", "engine_restarts_total",
                          "Engines in this process whose engine core died, by engine key and outcome: replaced, "
                          "failed (the replacement did not start) or given_up (past engine_restarts.limit)",
                          ("engine", "outcome"))

TENANT_REQUESTS = _Metric("counter", "tenant_requests_total",
                          "Requests admitted or refused by tenant (outcome: admitted or the limit that refused)",
                          ("tenant", "outcome"))


def observe_engine_restart(engine: str, outcome: str) -> None:
    ENGINE_RESTARTS.record(1, engine=engine, outcome=outcome)


def observe_tenant(tenant: str, outcome: str) -> None:
    TENANT_REQUESTS.record(1, tenant=tenant, outcome=outcome)


# 429 a rate limit; overload is Anthropic's 529 and the OpenAI APIs' 503 (ingress/openai_errors.py), where a
# Responses store outage also answers 503: rare enough that the counter stays a fair overload signal.
OVERLOAD_STATUSES = (429, 503, 529)


def observe_request(api: str, status: int, tenant: str | None = None) -> None:
    REQUESTS.record(1, api=api, status=str(status), tenant=tenant or "none")
    if status in OVERLOAD_STATUSES:
        OVERLOAD_REJECTIONS.record(1, api=api)


def observe_error(api: str, kind: str) -> None:
    ERRORS.record(1, api=api, kind=kind)


def observe_ttft(api: str, seconds: float) -> None:
    TTFT.record(max(0.0, seconds), api=api)


def observe_inter_token(api: str, seconds: float) -> None:
    ITL.record(max(0.0, seconds), api=api)


def observe_usage(api: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int = 0,
                  tenant: str | None = None) -> None:
    tenant = tenant or "none"
    PROMPT_TOKENS.record(prompt_tokens, api=api, tenant=tenant)
    CACHED_TOKENS.record(cached_tokens, api=api, tenant=tenant)
    COMPLETION_TOKENS.record(completion_tokens, api=api, tenant=tenant)
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


async def instrument_stream(api: str, events: AsyncIterator, started: float | None = None,
                            tenant: str | None = None) -> AsyncIterator:
    """Yield `events` unchanged while recording TTFT, inter-token gaps, output rate, usage and the finish reason.

    `started` is the request's arrival time (`time.monotonic()`); it defaults to when iteration starts. `tenant`:
    whose usage the token counters count it as. Closing this generator closes `events` (so a client disconnect
    still aborts the engine request).
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
            observe_usage(api, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, tenant)
            if first is not None and last is not None:
                observe_output_rate(api, usage.completion_tokens, last - first)
