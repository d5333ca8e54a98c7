"""The Grafana dashboard `kuberay/monitoring/grafana-dashboard.json`, from the panel list below; written (and
checked for drift) by `python kuberay/generate.py` with the manifests.

Every query reads what Ray's metrics agent exports on each node's metrics port (`ray_` + the metric's name):
the service's metrics (`serve_app/metrics.py`, `ray_serve_app_*`) and vLLM's engine metrics (`ray_vllm_*`, one
series per engine replica, labelled `ReplicaId`). docs/operations.md says what each panel means;
tests/unit/test_dashboard.py checks every query against the metrics the code defines, and
tests/integration/test_metrics_dashboard.py that each one has samples after traffic.
"""

from __future__ import annotations

import json

R = "$__rate_interval"


def _q(expr: str, legend: str) -> dict:
    return {"expr": expr, "legend": legend}


def _quantiles(metric: str, by: str, qs=(0.5, 0.95)) -> list[dict]:
    return [_q(f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket[{R}])))",
               f"{{{{{by}}}}} p{int(q * 100)}") for q in qs]


# (row title, [(panel title, unit, description, [queries])])
ROWS: list[tuple[str, list[tuple[str, str, str, list[dict]]]]] = [
    ("Service, per API", [
        ("Requests by API and status", "reqps", "HTTP requests per second through the ingress, by API and status.",
         [_q(f"sum by (api, status) (rate(ray_serve_app_requests_total[{R}]))", "{{api}} {{status}}")]),
        ("Time to first token", "s",
         "Request arrival at the ingress to the first content event (text, reasoning or tool call), per API.",
         _quantiles("ray_serve_app_ttft_seconds", "api")),
        ("Inter-token latency", "s", "Gap between consecutive content events of a stream, per API.",
         _quantiles("ray_serve_app_inter_token_seconds", "api", (0.5, 0.99))),
        ("Cached prompt fraction", "percentunit",
         "Prompt tokens served from vLLM's prefix cache over all prompt tokens, per API.",
         [_q(f"sum by (api) (rate(ray_serve_app_cached_tokens_total[{R}])) / "
             f"sum by (api) (rate(ray_serve_app_prompt_tokens_total[{R}]))", "{{api}}")]),
        ("Output tokens per second", "short", "Completion tokens streamed per second, per API.",
         [_q(f"sum by (api) (rate(ray_serve_app_completion_tokens_total[{R}]))", "{{api}}")]),
        ("Finish reasons", "short", "Finished generations per second by finish reason (error: the engine failed).",
         [_q(f"sum by (api, reason) (rate(ray_serve_app_finish_total[{R}]))", "{{api}} {{reason}}")]),
    ]),
    ("Routing", [
        ("Router decisions and fallbacks", "short",
         "Routing decisions per second by policy and outcome: cache_hit / cache_miss for the configured policy; "
         "policy 'fallback' (outcome router_unavailable) when the Router did not answer and Serve's own routing "
         "chose.",
         [_q(f"sum by (policy, outcome) (rate(ray_serve_app_router_decisions_total[{R}]))",
             "{{policy}} {{outcome}}")]),
        ("Ingress admission per replica", "short", "Requests holding an admission slot in each ingress replica.",
         [_q('sum by (replica) (ray_serve_app_queue_depth{component="ingress"})', "{{replica}}")]),
    ]),
    ("Engines (vLLM), per replica", [
        ("Engine queue per replica", "short", "Requests waiting for and running in each engine replica's batch.",
         [_q("sum by (model_name, ReplicaId) (ray_vllm_num_requests_waiting)", "waiting {{ReplicaId}}"),
          _q("sum by (model_name, ReplicaId) (ray_vllm_num_requests_running)", "running {{ReplicaId}}")]),
        ("KV cache usage per replica", "percentunit", "Fraction of each engine replica's KV cache blocks in use.",
         [_q("max by (model_name, ReplicaId) (ray_vllm_kv_cache_usage_perc)", "{{ReplicaId}}")]),
        ("Engine prefix-cache hit rate per replica", "percentunit",
         "Prompt tokens found in each replica's prefix cache over tokens looked up (the router's aim).",
         [_q(f"sum by (ReplicaId) (rate(ray_vllm_prefix_cache_hits_total[{R}])) / "
             f"sum by (ReplicaId) (rate(ray_vllm_prefix_cache_queries_total[{R}]))", "{{ReplicaId}}")]),
        ("Engine time to first token", "s", "vLLM's own TTFT (engine arrival to first token), per replica.",
         _quantiles("ray_vllm_time_to_first_token_seconds", "ReplicaId")),
    ]),
    ("Tenants", [
        ("429 / 503 / 529 per tenant", "reqps",
         "Responses refused per second by tenant: 429 a tenant limit (or rate limit); the service overloaded is "
         "529 on the Anthropic API and 503 on the OpenAI APIs (where a Responses store outage is 503 too).",
         [_q(f'sum by (tenant, status) (rate(ray_serve_app_requests_total{{status=~"429|503|529"}}[{R}]))',
             "{{tenant}} {{status}}")]),
        ("Tenant refusals by limit", "reqps", "Requests a tenant's own limit refused, by the limit that refused.",
         [_q(f'sum by (tenant, outcome) (rate(ray_serve_app_tenant_requests_total{{outcome!="admitted"}}[{R}]))',
             "{{tenant}} {{outcome}}")]),
        ("Admitted requests per tenant", "reqps", "Requests admitted per second, by tenant.",
         [_q(f'sum by (tenant) (rate(ray_serve_app_tenant_requests_total{{outcome="admitted"}}[{R}]))',
             "{{tenant}}")]),
        ("Tokens per tenant", "short",
         "Who uses the capacity: prompt tokens computed (not served from the prefix cache) and completion tokens "
         "per second, by tenant.",
         [_q(f"sum by (tenant) (rate(ray_serve_app_prompt_tokens_total[{R}])) - "
             f"sum by (tenant) (rate(ray_serve_app_cached_tokens_total[{R}]))", "{{tenant}} prompt computed"),
          _q(f"sum by (tenant) (rate(ray_serve_app_completion_tokens_total[{R}]))", "{{tenant}} completion")]),
        ("Cached prompt fraction per tenant", "percentunit",
         "Prompt tokens served from the prefix cache over all prompt tokens, by tenant (a tenant's own cache "
         "namespace: its cache_group).",
         [_q(f"sum by (tenant) (rate(ray_serve_app_cached_tokens_total[{R}])) / "
             f"sum by (tenant) (rate(ray_serve_app_prompt_tokens_total[{R}]))", "{{tenant}}")]),
    ]),
]


def dashboard() -> dict:
    panels: list[dict] = []
    y = 0
    pid = 1
    for row_title, row_panels in ROWS:
        panels.append({"type": "row", "title": row_title, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid += 1
        y += 1
        for i, (title, unit, description, queries) in enumerate(row_panels):
            panels.append({
                "type": "timeseries",
                "title": title,
                "description": description,
                "id": pid,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "desc"}},
                "targets": [{"datasource": {"type": "prometheus", "uid": "${datasource}"}, "expr": q["expr"],
                             "legendFormat": q["legend"], "refId": chr(ord("A") + k)}
                            for k, q in enumerate(queries)],
            })
            pid += 1
        y += 8 * ((len(row_panels) + 1) // 2)
    return {
        "uid": "serve-app",
        "title": "serve_app: agent inference service",
        "description": "Ray Serve + vLLM service for coding agents: per-API latency, cache, routing, engines, tenants",
        "tags": ["serve_app", "ray", "vllm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0}]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"
