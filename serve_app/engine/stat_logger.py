"""vLLM's engine metrics through Ray's metrics, without the per-token cost of recording them.

vLLM's Prometheus stat logger records on every engine step: it observes `vllm:inter_token_latency_seconds` once
per running request (once per generated token), and sets about ten gauges (running, waiting, KV usage...) and
increments the token counters. Through Ray's metrics each of those is a native record call. Profiled on the
frontend-bound tiny model (docs/serving-path.md), the inter-token histogram was a quarter of the engine replica's
output-handling thread at concurrency 128, and the per-step gauges and counters about a tenth of the ingress's busy
time at concurrency 1, where every step carries one token.

So this logger
- does not export the engine's inter-token histogram: the latency a client sees between tokens is recorded by the
  ingress instead, per API (`ray_serve_app_inter_token_seconds`, after parsing and framing, which is what an
  operator wants);
- hands vLLM's gauges and counters to the service's metrics buffer (`metrics._Flusher`): a gauge's latest value
  and a counter's accumulated increments reach Ray at most every half second, from one thread, instead of on every
  step. What Ray exports is the same, at most that much later. Histograms are recorded as vLLM records them.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.ray_wrappers import RayCounterWrapper, RayGaugeWrapper, RayPrometheusStatLogger

from serve_app import metrics

# vLLM's per-engine children of metrics observed once per generated token.
PER_TOKEN_METRICS = ("histogram_inter_token_latency",)


class _NotExported:
    def observe(self, value: float) -> None:
        pass


class _BufferedGauge:
    """A labelled vLLM Ray gauge whose `set` goes through the metrics buffer."""

    def __init__(self, wrapper: RayGaugeWrapper):
        self.set = metrics._BUFFERED.recorder(wrapper.metric.set, wrapper._tags)

    def set_to_current_time(self) -> None:
        self.set(time.time())


class _BufferedCounter:
    """A labelled vLLM Ray counter whose `inc` goes through the metrics buffer."""

    def __init__(self, wrapper: RayCounterWrapper):
        self.inc = metrics._BUFFERED.counter(wrapper.metric.inc, wrapper._tags)


class _BufferedFamily:
    """An unlabelled vLLM Ray gauge or counter that vLLM labels on every step (`.labels(...).inc(n)`): each label
    set's buffered child is built once. Recorded without labels (`.set(v)`, `.inc(n)`), it is its own child."""

    def __init__(self, wrapper: RayGaugeWrapper | RayCounterWrapper):
        self._wrapper = wrapper
        self._children: dict[tuple, Any] = {}
        self._self: Any = None

    def labels(self, *labels, **labelskwargs):
        key = (labels, tuple(sorted(labelskwargs.items())))
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = _labelled(self._wrapper.labels(*labels, **labelskwargs))
        return child

    def __getattr__(self, name: str):  # set / inc / set_to_current_time on the unlabelled metric
        if name.startswith("_"):
            raise AttributeError(name)
        if self._self is None:
            self._self = _labelled(self._wrapper)
        return getattr(self._self, name)


def _labelled(wrapper: RayGaugeWrapper | RayCounterWrapper) -> "_BufferedGauge | _BufferedCounter":
    return _BufferedGauge(wrapper) if isinstance(wrapper, RayGaugeWrapper) else _BufferedCounter(wrapper)


def _buffered(value: Any) -> Any:
    """`value` with every Ray gauge and counter in it (dicts and lists followed) replaced by a buffered one; `value`
    itself when it holds none."""
    if isinstance(value, (RayGaugeWrapper, RayCounterWrapper)):
        return _labelled(value) if value._is_labeled else _BufferedFamily(value)
    if isinstance(value, dict):
        new = {k: _buffered(v) for k, v in value.items()}
        return value if all(new[k] is v for k, v in value.items()) else new
    if isinstance(value, list):
        items = [_buffered(v) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else items
    return value


def buffer_metrics(obj: Any, depth: int = 1) -> int:
    """Replace the Ray gauges and counters held in `obj`'s attributes by buffered ones; also in the attributes of
    vLLM helper objects it holds (spec-decoding, KV-connector, perf metrics), `depth` levels down. Returns how many
    attributes changed."""
    changed = 0
    for name, value in list(vars(obj).items()):
        new = _buffered(value)
        if new is not value:
            setattr(obj, name, new)
            changed += 1
        elif depth > 0 and type(value).__module__.startswith("vllm.") and hasattr(value, "__dict__"):
            changed += buffer_metrics(value, depth - 1)
    return changed


def drop_per_token_metrics(logger: Any) -> None:
    """Stop `logger` (a vLLM Prometheus stat logger) observing the metrics it would observe once per token."""
    for attr in PER_TOKEN_METRICS:
        children = getattr(logger, attr, None)
        if isinstance(children, dict):  # engine index -> labelled child (vllm/v1/metrics/utils.py)
            setattr(logger, attr, {idx: _NotExported() for idx in children})


class EngineStatLogger(RayPrometheusStatLogger):
    """In a Ray worker: vLLM's metrics through Ray's, buffered, without the per-token ones."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        drop_per_token_metrics(self)
        buffer_metrics(self)


# One registry per engine of this process (LocalEngineStatLogger): vLLM's Prometheus logger registers its metrics
# in prometheus_client's global registry and unregisters every `vllm:` metric there first, so with two engines in one
# process only the last one's would be left.
# Served model name (one per engine: its first model's id) -> that engine's registry. A replacement of a dead engine
# (engine/local_client.py) builds a new logger under the same name, which takes the dead one's place.
ENGINE_REGISTRIES: dict[str, CollectorRegistry] = {}


class LocalEngineStatLogger(PrometheusStatLogger):
    """Outside Ray (serve_app/single_process.py): vLLM's metrics in a Prometheus registry of this engine's own
    (`ENGINE_REGISTRIES`, exposed together by `engine_metrics`), without the per-token ones: the engine's output
    handler runs on the serving event loop there, so each observation per token is time the streams wait for."""

    # vLLM's helpers that build metrics of their own (MFU estimates, speculative decoding, KV/EC connectors).
    HELPERS = ("_perf_metrics_cls", "_spec_decoding_cls", "_kv_connector_cls", "_ec_connector_cls")

    def __init__(self, *args, **kwargs):
        registry = CollectorRegistry(auto_describe=True)
        kinds = {"_gauge_cls": functools.partial(Gauge, registry=registry),
                 "_counter_cls": functools.partial(Counter, registry=registry),
                 "_histogram_cls": functools.partial(Histogram, registry=registry)}
        for name, cls in kinds.items():
            setattr(self, name, cls)
        # The helpers' metric classes are class attributes of their own: in prometheus_client's global registry,
        # the next engine's logger would unregister this one's (only the last engine's MFU counters were left).
        for name in self.HELPERS:
            helper = getattr(self, name)
            setattr(self, name, type(helper.__name__, (helper,), {k: v for k, v in kinds.items()
                                                                   if hasattr(helper, k)}))
        super().__init__(*args, **kwargs)
        drop_per_token_metrics(self)
        ENGINE_REGISTRIES[str(self.vllm_config.model_config.served_model_name)] = registry


class _Merged:
    """The engines' registries as one collector: a metric family every engine has is one family with every
    engine's samples (their `model_name` labels tell them apart), as Prometheus's text format requires."""

    def collect(self):
        families: dict[str, Any] = {}
        for registry in list(ENGINE_REGISTRIES.values()):
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    families[family.name] = family
                else:
                    merged.samples.extend(family.samples)
        return iter(families.values())


def engine_metrics() -> bytes:
    """The Prometheus text of every engine in this process (LocalEngineStatLogger); empty without any."""
    return generate_latest(_Merged()) if ENGINE_REGISTRIES else b""
