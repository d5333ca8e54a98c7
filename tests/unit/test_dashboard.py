"""The Grafana dashboard and the Prometheus scrape config in kuberay/monitoring/: every panel queries metrics the
code defines (the service's in serve_app/metrics.py, vLLM's engine metrics), with labels those metrics carry, as
Ray's metrics agent exports them; the scrape config reaches the port every Ray container exports them on.
That each query has samples after real traffic: tests/integration/test_metrics_dashboard.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import vllm
import yaml

from serve_app import metrics
from tests.support.prometheus import grouping_labels, selectors

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "kuberay" / "monitoring"
DASHBOARD = json.loads((MONITORING / "grafana-dashboard.json").read_text())
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
VLLM_LABELS = {"model_name", "engine", "ReplicaId"}  # ReplicaId: added by vLLM's Ray stat logger


def exported_names() -> dict[str, set[str]]:
    """Sample name as Ray exports it (`ray_` + name; counters end in `_total`) -> the labels it carries."""
    out: dict[str, set[str]] = {}
    for m in vars(metrics).values():
        if not isinstance(m, metrics._Metric):
            continue
        base = metrics.RAY_EXPORT_PREFIX + metrics.PREFIX + m.name
        if m.kind == "histogram":
            for suffix in HISTOGRAM_SUFFIXES:
                out[base + suffix] = set(m.exported_labels) | ({"le"} if suffix == "_bucket" else set())
        else:
            out[base] = set(m.exported_labels)
    source = (Path(vllm.__file__).parent / "v1" / "metrics" / "loggers.py").read_text()
    for kind, name in re.findall(r'_(gauge|counter|histogram)_cls\(\s*name="(vllm:[a-z_]+)"', source):
        # vLLM's Ray wrappers turn `vllm:` into `vllm_` (Ray's metric names allow no colon).
        base = metrics.RAY_EXPORT_PREFIX + name.replace(":", "_")
        if kind == "histogram":
            for suffix in HISTOGRAM_SUFFIXES:
                out[base + suffix] = VLLM_LABELS | ({"le"} if suffix == "_bucket" else set())
        else:
            out[base + ("_total" if kind == "counter" else "")] = set(VLLM_LABELS)
    return out


def panels() -> list[dict]:
    return [p for p in DASHBOARD["panels"] if p["type"] != "row"]


def problems(dashboard: dict) -> list[str]:
    """What is wrong with the dashboard's queries against the metrics the code defines (empty: nothing)."""
    known = exported_names()
    found = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            sels = selectors(expr)
            if not sels:
                found.append(f"{panel['title']}: no metric in {expr!r}")
            for sel in sels:
                if sel.name not in known:
                    found.append(f"{panel['title']}: {sel.name} is not a metric the service or vLLM exports")
                    continue
                for label in {m.label for m in sel.matchers} | grouping_labels(expr):
                    if label not in known[sel.name]:
                        found.append(f"{panel['title']}: {sel.name} has no label {label}")
    return found


def test_every_query_reads_metrics_and_labels_that_exist():
    assert problems(DASHBOARD) == []


@pytest.mark.parametrize("bad_expr, complaint", [
    ("sum(rate(ray_serve_app_ttft_second_bucket[5m]))", "is not a metric"),
    ('sum by (tenant) (rate(ray_serve_app_ttft_seconds_bucket{api="chat"}[5m]))', "has no label tenant"),
    ("sum by (ReplicaId) (ray_vllm_num_requests_waiting_total)", "is not a metric"),
    ("sum by (replica) (ray_serve_app_requests_total)", "has no label replica"),
])
def test_the_check_catches_a_wrong_name_or_label(bad_expr, complaint):
    bad = {"panels": [{"type": "timeseries", "title": "t", "targets": [{"expr": bad_expr, "refId": "A"}]}]}
    assert any(complaint in p for p in problems(bad))


def test_the_panels_the_issue_asks_for():
    used = {(sel.name, m.label, m.value) for p in panels() for t in p["targets"] for sel in selectors(t["expr"])
            for m in sel.matchers}
    names = {sel.name for p in panels() for t in p["targets"] for sel in selectors(t["expr"])}
    grouped = {(sel.name, label) for p in panels() for t in p["targets"] for sel in selectors(t["expr"])
               for label in grouping_labels(t["expr"])}
    assert ("ray_serve_app_ttft_seconds_bucket", "api") in grouped
    assert ("ray_serve_app_inter_token_seconds_bucket", "api") in grouped
    assert {"ray_serve_app_cached_tokens_total", "ray_serve_app_prompt_tokens_total"} <= names
    assert ("ray_serve_app_router_decisions_total", "outcome") in grouped  # fallbacks: policy "fallback"
    assert ("ray_vllm_num_requests_waiting", "ReplicaId") in grouped
    assert ("ray_vllm_kv_cache_usage_perc", "ReplicaId") in grouped
    assert ("ray_serve_app_queue_depth", "replica") in grouped
    assert ("ray_serve_app_requests_total", "status", "429|503|529") in used
    assert ("ray_serve_app_requests_total", "tenant") in grouped


def test_dashboard_structure_imports_into_grafana():
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    assert DASHBOARD["uid"] and DASHBOARD["title"] and DASHBOARD["schemaVersion"] >= 36
    (ds,) = [v for v in DASHBOARD["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
    cells: set[tuple[int, int]] = set()
    for p in DASHBOARD["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
    for p in panels():
        assert p["datasource"]["uid"] == "${" + ds["name"] + "}" and p["description"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs))
        assert all(t["datasource"]["uid"] == "${" + ds["name"] + "}" and t["legendFormat"] for t in p["targets"])


def _ray_containers(manifest: dict) -> list[tuple[dict, dict]]:
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [(g, c) for g in groups for c in g["template"]["spec"]["containers"]]


@pytest.mark.parametrize("path", sorted((ROOT / "kuberay").glob("rayservice-*.yaml")), ids=lambda p: p.name)
def test_scrape_configs_select_every_ray_pod_on_its_metrics_port(path):
    manifest = yaml.safe_load(path.read_text())
    monitor = yaml.safe_load((MONITORING / "podmonitor.yaml").read_text())
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    plain = yaml.safe_load((MONITORING / "prometheus-scrape.yaml").read_text())["scrape_configs"][0]
    keeps = {r["source_labels"][0]: r["regex"] for r in plain["relabel_configs"] if r.get("action") == "keep"}
    for group, container in _ray_containers(manifest):
        (port,) = [p for p in container["ports"] if p["name"] == endpoint["port"]]
        assert group["rayStartParams"]["metrics-export-port"] == str(port["containerPort"])
        # KubeRay adds ray.io/is-ray-node itself; the app's own label comes from the pod template.
        labels = {"ray.io/is-ray-node": "yes", **group["template"]["metadata"]["labels"]}
        assert selector.items() <= labels.items()
        for key, value in labels.items():
            meta = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            assert keeps.get(meta, value) == value
        assert keeps["__meta_kubernetes_pod_container_port_name"] == port["name"]
