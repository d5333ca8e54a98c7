"""The README's first command, `python -m serve_app run config.yaml`, for real: a subprocess starts its own local
Ray (no dashboard modules, no idle pooled workers, no usage statistics), deploys config.yaml through Serve's `serve
run`, answers through the SDK and through the real Claude Code CLI, still relays Ray's metrics agent on /metrics,
reports its status without the dashboard (`python -m serve_app status`), and a SIGINT (Ctrl-C) stops Serve and
every process that Ray started.

The config is config.yaml as shipped — both engines in the ingress, no proxy (`ingress.listen`), the Responses
store in the ingress — with the test hooks only: another port, the suite's forced scripts (so the engine says
exactly what a test expects), and a Responses file of the test's. Marked `own_cluster`: it runs after the
session's server has stopped, so this Ray is the only one on the host.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import yaml

from serve_app import metrics
from tests.support.launched import ROOT, interrupted_cleanly, launch, titles, tree

pytestmark = [pytest.mark.integration, pytest.mark.own_cluster]

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def launched(without_session_server, tmp_path_factory):
    yield from launch(tmp_path_factory.mktemp("launch"))


def test_it_serves_the_config(launched):
    _, url, _ = launched
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"nvext": {"forced_script": "Launched and serving."}})
    assert reply.choices[0].message.content == "Launched and serving."


def test_claude_codes_tool_loop_runs_through_it_and_reuses_the_prefix(launched, tmp_path):
    """The real Claude Code CLI on config.yaml's no-proxy front: its ~20K-token first request on the 32K engine (the
    alias it asks for), a Bash call parsed from the stream (config.yaml's model has no reasoning parser, so the
    script's think block is plain text there), the call run, and the second request finding the first's prefix in
    the engine's cache — the product's promise, on the first command's config."""
    sys.path.insert(0, str(ROOT / "tests" / "conformance"))
    from npm_tools import CLAUDE_CODE, ensure, unavailable
    from test_claude_code import check_bash_loop_reused_the_prefix, run_claude

    claude = ensure(CLAUDE_CODE)
    r = subprocess.run([str(claude), "--version"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        unavailable(f"the installed claude binary does not run here: {r.stderr[-300:]}")
    _, url, _ = launched
    out = run_claude(claude, url, tmp_path / "home", "CONFORMANCE_BASH_LOOP: run the command", "--allowedTools", "Bash")
    first, _ = check_bash_loop_reused_the_prefix(out)
    assert first["input_tokens"] + first["cache_read_input_tokens"] > 5000, first  # Claude Code's real prompt


def test_its_responses_store_lives_in_the_ingress(launched):
    """No ResponseStore deployment (test_its_status_comes_from_the_controller... checks), yet a stored response is
    found again and continues, from the SQLite file the ingress opened itself."""
    import sqlite3

    _, url, log = launched
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    first = client.responses.create(model=MODEL, input="Remember the word teal.", max_output_tokens=8, store=True,
                                    extra_body={"nvext": {"forced_script": "Noted: teal."}})
    second = client.responses.create(model=MODEL, input="Which word?", previous_response_id=first.id,
                                     max_output_tokens=8, extra_body={"nvext": {"forced_script": "teal"}})
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens, (first.usage,
                                                                                              second.usage)
    assert client.responses.retrieve(first.id).output_text == "Noted: teal."
    with sqlite3.connect(log.parent / "responses.sqlite3") as db:
        ids = [row[0] for row in db.execute("SELECT id FROM responses")]
    assert any(first.id in i for i in ids) and any(second.id in i for i in ids), ids


def test_its_metrics_still_reach_the_service_port(launched):
    # Ray's metrics agent runs in the dashboard agent, which the lean Ray keeps: /metrics relays it.
    _, url, _ = launched
    name = metrics.RAY_EXPORT_PREFIX + metrics.PREFIX + "requests_total"
    deadline = time.monotonic() + 90  # agents report every few seconds (metrics_report_interval_ms)
    while name not in (text := httpx.get(f"{url}/metrics", timeout=30).text):
        assert time.monotonic() < deadline, text[-2000:]
        time.sleep(2)


def test_its_ray_runs_no_dashboard_modules_idle_workers_or_usage_reports(launched):
    proc, _, _ = launched
    names = titles(tree(proc.pid))
    assert any("raylet" in t for t in names) and any("gcs_server" in t for t in names), names
    # Ray's dashboard with its modules runs one process per module (`ray-dashboard-NodeHead-0`, ...).
    assert not [t for t in names if t.startswith("ray-dashboard-")], names
    # Idle pooled workers (`ray::IDLE`) are stopped once idle: the deploy-time ones go within seconds.
    deadline = time.monotonic() + 60
    while [t for t in titles(tree(proc.pid)) if t.strip() == "ray::IDLE"]:
        assert time.monotonic() < deadline, titles(tree(proc.pid))
        time.sleep(1)
    raylet = next(p for p in tree(proc.pid) if "raylet" in " ".join(p.cmdline()))
    assert raylet.environ().get("RAY_USAGE_STATS_ENABLED") == "0"


def test_its_status_comes_from_the_controller_without_a_dashboard(launched):
    """`python -m serve_app status` shows what `serve status` would, which asks the dashboard this Ray runs without."""
    _, _, log = launched
    served = yaml.safe_load((log.parent / "config.yaml").read_text())["applications"][0]["args"]
    replicas = served["ingress"].get("deployment", {}).get("num_replicas", 1)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the Ray on this host: the launched one
    r = subprocess.run([sys.executable, "-m", "serve_app", "status", "--json"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    app = json.loads(r.stdout)["applications"]["default"]
    assert app["status"] == "RUNNING", app
    assert app["deployments"]["Ingress"] == {"status": "HEALTHY", "status_trigger": app["deployments"]["Ingress"][
        "status_trigger"], "replica_states": {"RUNNING": replicas}, "message": ""}, app
    # The engines and the Responses store in the ingress: no Router, no ResponseStore.
    assert "ResponseStore" not in app["deployments"] and "Router" not in app["deployments"], app


def test_sigint_stops_serve_and_all_of_its_ray(launched):
    proc, url, log = launched
    assert len(tree(proc.pid)) > 5
    interrupted_cleanly(proc, url, log, lambda: proc.send_signal(signal.SIGINT), timeout_s=180)
