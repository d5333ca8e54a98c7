"""vLLM's per-step gauges and counters reach Ray through the metrics buffer (serve_app/engine/stat_logger.py): the
same totals and latest values, one Ray call per metric and label set per flush instead of one per engine step."""

from __future__ import annotations

import pytest

from serve_app import metrics
from serve_app.engine import stat_logger
from vllm.v1.metrics.ray_wrappers import RayCounterWrapper, RayGaugeWrapper, RayHistogramWrapper
from vllm.v1.metrics.utils import create_metric_per_engine


class _Manual(metrics._Flusher):
    def _start(self):  # flushed by the test, not by a thread
        pass


class _Calls:
    """Stands in for a `ray.util.metrics` metric: records what would have gone to Ray's core worker."""

    def __init__(self, log: list, name: str, real):
        self.log, self.name = log, name
        self._tag_keys = real._tag_keys  # what vLLM's `labels()` reads

    def set(self, value, tags=None):
        self.log.append((self.name, "set", value, tags.get("engine")))

    def inc(self, value, tags=None):
        self.log.append((self.name, "inc", value, tags.get("engine")))

    def observe(self, value, tags=None):
        self.log.append((self.name, "observe", value, tags.get("engine")))


def _per_engine(cls, name: str, log: list, engines=(0, 1)) -> dict:
    extra = {"buckets": [1, 8, 64]} if cls is RayHistogramWrapper else {}
    parent = cls(f"vllm:{name}", "doc", ["model_name", "engine"], **extra)
    parent.metric = _Calls(log, name, parent.metric)  # the labelled children copy the parent's metric
    return create_metric_per_engine(parent, {i: ["m", str(i)] for i in engines})


class _Holder:
    """The shape of vLLM's PrometheusStatLogger attributes this module rewrites."""

    def __init__(self, log: list):
        self.gauge_running = _per_engine(RayGaugeWrapper, "running", log)
        self.gauge_waiting_by_reason = {"capacity": _per_engine(RayGaugeWrapper, "waiting", log)}
        self.counter_generation_tokens = _per_engine(RayCounterWrapper, "generation_tokens", log)
        self.histogram_iteration_tokens = _per_engine(RayHistogramWrapper, "iteration_tokens", log)
        family = RayCounterWrapper("vllm:cached_by_source", "doc", ["model_name", "engine", "source"])
        family.metric = _Calls(log, "cached_by_source", family.metric)
        self.counter_cached_by_source = family
        self.per_engine_labelvalues = {0: ["m", "0"], 1: ["m", "1"]}


@pytest.fixture
def buffer(monkeypatch):
    flusher = _Manual()
    monkeypatch.setattr(metrics, "_BUFFERED", flusher)
    return flusher


def _step(h: _Holder, engine: int, running: int, tokens: int, cached: int) -> None:
    """What vLLM's `record` does for one engine step, through the same attribute shapes."""
    h.gauge_running[engine].set(running)
    h.gauge_waiting_by_reason["capacity"][engine].set(0)
    h.counter_generation_tokens[engine].inc(tokens)
    h.histogram_iteration_tokens[engine].observe(tokens)
    h.counter_cached_by_source.labels("m", str(engine), "device").inc(cached)


def test_steps_reach_ray_once_per_flush_with_the_same_totals_and_latest_values(buffer):
    log: list = []
    h = _Holder(log)
    assert stat_logger.buffer_metrics(h) == 4  # gauges, the reason-keyed gauges, the counter, the family
    assert h.per_engine_labelvalues == {0: ["m", "0"], 1: ["m", "1"]}  # not metrics: untouched
    steps = [(0, 3, 3, 0), (0, 2, 2, 128), (1, 1, 1, 0), (0, 2, 2, 0), (1, 1, 1, 256), (0, 1, 1, 0)]
    for s in steps:
        _step(h, *s)
    # Histograms are recorded as vLLM records them, once per step.
    assert [x for x in log if x[1] != "observe"] == []
    assert [(x[2], x[3]) for x in log] == [(t, str(e)) for e, _, t, _ in steps]
    log.clear()
    buffer.flush()
    got = sorted(log)
    assert got == sorted([
        ("cached_by_source", "inc", 128, "0"), ("cached_by_source", "inc", 256, "1"),
        ("generation_tokens", "inc", 3 + 2 + 2 + 1, "0"), ("generation_tokens", "inc", 1 + 1, "1"),
        ("running", "set", 1, "0"), ("running", "set", 1, "1"),
        ("waiting", "set", 0, "0"), ("waiting", "set", 0, "1"),
    ])
    log.clear()
    buffer.flush()  # nothing happened since: nothing sent
    assert log == []
    _step(h, 1, 4, 5, 0)
    buffer.flush()
    assert sorted(log) == [("generation_tokens", "inc", 5, "1"), ("iteration_tokens", "observe", 5, "1"),
                           ("running", "set", 4, "1"), ("waiting", "set", 0, "1")]


def test_a_family_builds_each_label_sets_child_once(buffer):
    log: list = []
    h = _Holder(log)
    stat_logger.buffer_metrics(h)
    family = h.counter_cached_by_source
    assert family.labels("m", "0", "device") is family.labels("m", "0", "device")
    assert family.labels("m", "0", "device") is not family.labels("m", "0", "cpu")


def test_an_unlabelled_metric_recorded_directly_is_buffered_too(buffer):
    log: list = []

    class Plain:
        def __init__(self):
            g = RayGaugeWrapper("vllm:plain_gauge", "doc")
            g.metric = _Calls(log, "plain_gauge", g.metric)
            c = RayCounterWrapper("vllm:plain_counter", "doc")
            c.metric = _Calls(log, "plain_counter", c.metric)
            self.gauge, self.counter = g, c

    h = Plain()
    stat_logger.buffer_metrics(h)
    for v in (1, 2, 3):
        h.gauge.set(v)
        h.counter.inc(v)
    assert log == []
    buffer.flush()
    assert sorted(log) == [("plain_counter", "inc", 6, None), ("plain_gauge", "set", 3, None)]


def test_counter_increments_added_during_a_flush_are_sent_by_the_next(buffer):
    sent: list = []
    inc = buffer.counter(lambda v, tags: sent.append(v), {"k": "v"})
    inc(2)
    inc(0)  # Ray's counters refuse zero: never sent
    inc(-1)
    buffer.flush()
    inc(3)
    buffer.flush()
    buffer.flush()
    assert sent == [2, 3]


def test_the_classes_buffered_are_the_ones_vllms_ray_logger_builds():
    """`buffer_metrics` recognises vLLM's Ray gauges and counters by class: if a vLLM upgrade builds others, this
    fails instead of the buffering silently doing nothing."""
    assert stat_logger.EngineStatLogger._gauge_cls is RayGaugeWrapper
    assert stat_logger.EngineStatLogger._counter_cls is RayCounterWrapper


def test_the_per_token_histogram_is_dropped_in_either_logger():
    """Both loggers (Ray's and the single process's) stop observing what vLLM observes once per token: the children
    of the attributes vLLM's Prometheus logger builds under those names (checked against its source, so a renamed
    attribute fails here rather than leaving the per-token cost in silently)."""
    import inspect

    from vllm.v1.metrics.loggers import PrometheusStatLogger

    source = inspect.getsource(PrometheusStatLogger.__init__)
    assert all(f"self.{attr} =" in source or f"self.{attr}:" in source for attr in stat_logger.PER_TOKEN_METRICS)
    assert issubclass(stat_logger.LocalEngineStatLogger, PrometheusStatLogger)
    assert not issubclass(stat_logger.LocalEngineStatLogger, stat_logger.RayPrometheusStatLogger)

    log: list = []
    logger = type("L", (), {})()
    logger.histogram_inter_token_latency = _per_engine(RayHistogramWrapper, "itl", log)
    logger.histogram_inter_token_latency[0].observe(0.01)
    assert len(log) == 1
    stat_logger.drop_per_token_metrics(logger)
    for child in logger.histogram_inter_token_latency.values():
        child.observe(0.01)
    assert len(log) == 1 and set(logger.histogram_inter_token_latency) == {0, 1}


def test_the_engines_of_one_process_are_one_exposition(monkeypatch):
    """Two engines in one process (the single-process server, config.yaml's two): each logger's metrics in its own
    registry, exposed as one family per name holding both engines' samples — valid Prometheus text, neither engine
    lost (vLLM's logger alone unregisters the previous engine's `vllm:` metrics from the global registry)."""
    from prometheus_client import CollectorRegistry, Counter
    from prometheus_client.parser import text_string_to_metric_families

    registries = {}
    for model in ("a", "b"):
        reg = CollectorRegistry()
        Counter("vllm:generation_tokens", "doc", ["model_name"], registry=reg).labels(model).inc(3 if model == "a" else 5)
        registries[model] = reg
    monkeypatch.setattr(stat_logger, "ENGINE_REGISTRIES", registries)
    text = stat_logger.engine_metrics().decode()
    assert text.count("# TYPE vllm:generation_tokens_total counter") == 1
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "vllm:generation_tokens"]
    totals = {s.labels["model_name"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert totals == {"a": 3.0, "b": 5.0}
    monkeypatch.setattr(stat_logger, "ENGINE_REGISTRIES", {})
    assert stat_logger.engine_metrics() == b""


def test_two_real_engine_loggers_in_one_process_keep_every_metric_of_both(monkeypatch):
    """vLLM's own loggers for two engines of one process (config.yaml's two models in the single-process server):
    every `vllm:` family holds both engines' samples, the MFU counters vLLM's helper builds included (they went to
    the global registry, where the second engine's logger unregistered the first's), and nothing is left in the
    global registry for the next engine to remove."""
    import copy
    import re

    import prometheus_client
    from vllm.engine.arg_utils import EngineArgs

    from serve_app.engine.provision import ensure_model

    monkeypatch.setattr(stat_logger, "ENGINE_REGISTRIES", {})
    first = EngineArgs(model=ensure_model("smollm2-135m-instruct"), served_model_name=["a"], enforce_eager=True,
                       max_model_len=2048).create_engine_config()
    second = copy.deepcopy(first)
    second.model_config.served_model_name = "b"
    for cfg in (first, second):
        stat_logger.LocalEngineStatLogger(cfg)
    text = stat_logger.engine_metrics().decode()
    families: dict[str, set[str]] = {}
    for name, model in re.findall(r'^(vllm:[a-z_:]+)\{[^}]*model_name="(\w)"', text, re.M):
        families.setdefault(name, set()).add(model)
    assert families["vllm:estimated_flops_per_gpu_total"] == {"a", "b"}
    assert families["vllm:num_requests_running"] == {"a", "b"}
    assert all(models == {"a", "b"} for models in families.values()), families
    assert "vllm:" not in prometheus_client.generate_latest().decode()
    # A replacement of a dead engine (engine/local_client.py) logs under the same name: it takes the dead one's
    # place, never a second set of samples with the same labels (invalid Prometheus text).
    stat_logger.LocalEngineStatLogger(copy.deepcopy(first))
    again = stat_logger.engine_metrics().decode()
    assert len(stat_logger.ENGINE_REGISTRIES) == 2
    assert again.count('vllm:num_requests_running{engine="0",model_name="a"}') == 1
