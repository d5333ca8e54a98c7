"""The Locust agent-session load test runs headless against the test server for a short fixed time with 0
failures, and its summary has sessions, TTFT and cached-token figures for every API it drove."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_locust_headless_agent_sessions(serve_url, tmp_path):
    """LOAD_RUN_TIME / LOAD_USERS lengthen the run; LOAD_REPORT_DIR keeps its CSV, HTML and JSON summary."""
    summary_path = tmp_path / "summary.json"
    run_time, users = os.environ.get("LOAD_RUN_TIME", "45s"), os.environ.get("LOAD_USERS", "4")
    cmd = [
        sys.executable, "-m", "locust", "-f", str(ROOT / "load" / "locustfile.py"), "--headless",
        "--host", serve_url, "--users", users, "--spawn-rate", users, "--run-time", run_time,
        "--stop-timeout", "180", "--html", str(tmp_path / "report.html"),
        "--scripted", "--max-turns", "3", "--system-tokens", "300", "--max-tokens", "64",
        "--summary-json", str(summary_path), "--csv", str(tmp_path / "stats"), "--only-summary",
        "ClaudeCodeSession", "CodexSession", "PlainChat",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    tail = (proc.stdout + proc.stderr)[-4000:]
    if os.environ.get("LOAD_REPORT_DIR"):
        shutil.copytree(tmp_path, os.environ["LOAD_REPORT_DIR"], dirs_exist_ok=True)
    assert proc.returncode == 0, tail  # Locust exits 1 when any request failed
    summary = json.loads(summary_path.read_text())
    assert summary["failures"] == 0 and summary["errors_by_type"] == {}, summary
    assert summary["requests"] > 0
    # The summary is a result file of its own (README figures cite it): it says what ran, at which commit, where.
    assert summary["command"].startswith("locust -f ") and summary["commit"] and summary["host"]["cpus"] >= 1
    for api in ("anthropic", "responses"):
        stats = summary["apis"][api]
        assert stats["sessions"] >= 1, summary
        assert stats["ttft_ms"]["n"] >= 3 and stats["ttft_ms"]["p50"] > 0, summary
        # Turn 2+ of a session re-sends turn 1's prefix: some of the prompt must come back as cached.
        assert stats["cached_pct"]["p95"] > 0, summary
    assert summary["apis"]["chat"]["ttft_ms"]["n"] >= 1, summary
