"""vLLM's engine metrics through Ray's metrics, without the one metric recorded per generated token.

vLLM's Prometheus stat logger observes `vllm:inter_token_latency_seconds` once per running request per engine
step, i.e. once per generated token. Through Ray's metrics each observation is a native record call: profiled at
concurrency 128 on the frontend-bound tiny model, a quarter of the engine replica's output-handling thread
(docs/serving-path.md). The latency a client sees between tokens is recorded by the ingress instead, per API
(`ray_serve_app_inter_token_seconds`, after parsing and framing, which is what an operator wants), so the
engine's copy is not exported. Every other vLLM metric (queue, KV usage, prefix-cache hits, its own TTFT, per
request times) is recorded as vLLM records it.
"""

from __future__ import annotations

from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

# vLLM's per-engine children of metrics observed once per generated token.
PER_TOKEN_METRICS = ("histogram_inter_token_latency",)


class _NotExported:
    def observe(self, value: float) -> None:
        pass


class EngineStatLogger(RayPrometheusStatLogger):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for attr in PER_TOKEN_METRICS:
            children = getattr(self, attr, None)
            if isinstance(children, dict):  # engine index -> labelled child (vllm/v1/metrics/utils.py)
                setattr(self, attr, {idx: _NotExported() for idx in children})
