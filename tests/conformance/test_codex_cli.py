"""The real Codex CLI against the service: `codex exec` answers through the Responses API with the catalog that
`python -m serve_app codex-config` generates (no fallback-metadata warning), and a forced tool loop (the model calls
`exec_command` with `echo hi …`, Codex runs it and sends the output back, the model answers) completes with the
second request reusing the first's prompt prefix.

Codex is npm-installed at test time into `.tools/codex` (gitignored); without npm or the registry the tests skip (fail under CI) and
say why. The model's words come from `tests/configs/script_rules/codex.yaml` (forced scripts keyed on markers in the
prompt), through the real engine. Per-request usage is read from Codex's own trace of the SSE it received.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from npm_tools import CODEX, ROOT, ensure, unavailable

pytestmark = [pytest.mark.conformance, pytest.mark.integration]

MODEL = "smollm2-135m-instruct-32k"  # Codex's request (tools + context) is ~6K tokens; the 32K engine holds it
CPU_BLOCK = 128


@pytest.fixture(scope="module")
def codex() -> Path:
    path = ensure(CODEX)
    r = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        unavailable(f"the installed codex binary does not run here: {r.stderr[-300:]}")
    return path


def make_codex_home(serve_url: str, tmp_path_factory, model: str) -> Path:
    """A fresh CODEX_HOME whose config.toml and catalog come from `python -m serve_app codex-config`, run as the
    README shows it: the test server takes requests without a key (its open `{tenant: default}` entry), so the
    command, asking it, names no env_key, and Codex starts without one."""
    home = tmp_path_factory.mktemp("codex-home")
    r = subprocess.run([sys.executable, "-m", "serve_app", "codex-config", "--base-url", serve_url,
                        "--config", str(ROOT / "tests" / "configs" / "test.yaml"),
                        "--catalog-out", str(home / "catalog.json"), "--model", model],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (home / "config.toml").write_text(r.stdout)
    return home


@pytest.fixture(scope="module")
def codex_home(serve_url, tmp_path_factory) -> Path:
    return make_codex_home(serve_url, tmp_path_factory, MODEL)


def run_codex(codex: Path, home: Path, workdir: Path, prompt: str) -> tuple[list[dict], list[dict], str]:
    """(codex --json events, SSE events Codex received, stderr)."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home.parent),
        "CODEX_HOME": str(home),
        "RUST_LOG": "codex_api=trace",  # Codex logs every SSE event it parses: per-request usage for the test
        "NO_COLOR": "1",
    }
    cmd = [str(codex), "exec", "--json", "--skip-git-repo-check", "--sandbox", "danger-full-access", prompt]
    r = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1200, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"codex exited {r.returncode}\nstdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-3000:]}"
    events = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    sse = []
    for line in r.stderr.splitlines():
        _, sep, payload = line.partition("SSE event: ")
        if sep:
            try:
                sse.append(json.loads(payload))
            except ValueError:
                pass
    return events, sse, r.stderr


def completed_usages(sse: list[dict]) -> list[dict]:
    return [e["response"]["usage"] for e in sse if e.get("type") == "response.completed"]


def completed_items(events: list[dict], kind: str) -> list[dict]:
    return [e["item"] for e in events if e.get("type") == "item.completed" and e["item"]["type"] == kind]


def test_exec_answers_with_catalog_metadata(codex, codex_home, tmp_path):
    events, sse, stderr = run_codex(codex, codex_home, tmp_path / "work", "CODEX_SAY_OK: reply with the word ok")
    assert "Model metadata" not in stderr and "fallback model metadata" not in stderr.lower(), stderr[-2000:]
    messages = [item["text"] for item in completed_items(events, "agent_message")]
    assert messages and messages[-1].strip() == "CODEX-OK"
    turn = [e for e in events if e.get("type") == "turn.completed"][-1]
    assert turn["usage"]["input_tokens"] > 1000  # Codex's real prompt: tools, permissions, environment
    # The catalog entry made Codex ask for reasoning summaries (the model has a reasoning parser) and got them.
    reasoning = completed_items(events, "reasoning")
    assert reasoning and "ok" in reasoning[0]["text"]
    assert [e["type"] for e in sse][-1] == "response.completed"


def check_exec_tool_loop(events: list[dict], sse: list[dict]) -> None:
    """The forced CODEX_TOOL_LOOP: Codex ran the model's `echo`, the model answered with its output, and turn 2 (turn
    1's prompt + the call + its output) took all of turn 1's whole KV blocks from the cache."""
    execs = completed_items(events, "command_execution")
    assert execs, f"Codex ran no command: {events}"
    assert "echo hi CODEX_TOOL_DONE" in execs[0]["command"]
    assert "hi CODEX_TOOL_DONE" in execs[0]["aggregated_output"] and execs[0]["exit_code"] == 0
    messages = [item["text"] for item in completed_items(events, "agent_message")]
    assert messages and messages[-1].strip() == "The command printed: hi CODEX_TOOL_DONE"
    usages = completed_usages(sse)
    assert len(usages) == 2, usages
    first, second = usages
    assert second["input_tokens_details"]["cached_tokens"] >= (first["input_tokens"] // CPU_BLOCK) * CPU_BLOCK, usages
    assert second["input_tokens"] > first["input_tokens"]


def test_forced_exec_command_tool_loop_reuses_prefix(codex, codex_home, tmp_path):
    events, sse, _ = run_codex(codex, codex_home, tmp_path / "work", "CODEX_TOOL_LOOP: run the command")
    check_exec_tool_loop(events, sse)


@pytest.mark.parametrize("model", ["codex-qwen3.6", "codex-ministral-3", "codex-deepseek-v3.2"])
def test_tool_loop_on_a_family_s_real_template(codex, serve_url, tmp_path_factory, tmp_path, model):
    """Codex's requests carry its instructions and developer messages (permissions, environment) and then two user
    messages (AGENTS.md and environment context, the prompt). Qwen3.6's template raises on any system message but
    the first; Ministral 3's too, and on two user turns in a row; DeepSeek-V3.2's encoder fails on a developer
    message before the last user message in thinking mode. On `codex-qwen3.6`, `codex-ministral-3` and
    `codex-deepseek-v3.2` (the 32K engine under the family's real template and parsers) the forced tool loop
    completes in the family's own wire format, and turn 2 reuses turn 1's prompt."""
    home = make_codex_home(serve_url, tmp_path_factory, model)
    events, sse, _ = run_codex(codex, home, tmp_path / "work", "CODEX_TOOL_LOOP: run the command")
    check_exec_tool_loop(events, sse)
    reasoning = [item["text"] for item in completed_items(events, "reasoning")]
    assert any("I will run the command." in r for r in reasoning), events


def test_forced_apply_patch_freeform_tool(codex, codex_home, tmp_path):
    """apply_patch is a `custom` (freeform) tool in Codex's request; the model's call must come back as a
    custom_tool_call with the raw patch, which Codex applies to the workspace."""
    work = tmp_path / "work"
    events, sse, _ = run_codex(codex, codex_home, work, "CODEX_PATCH_LOOP: add the greeting file")
    calls = [e["item"] for e in sse if e.get("type") == "response.output_item.done"
             and e["item"]["type"] == "custom_tool_call"]
    assert calls and calls[0]["name"] == "apply_patch" and calls[0]["input"].startswith("*** Begin Patch\n")
    assert (work / "hello_codex.txt").read_text() == "hello from the model\n"
    messages = [item["text"] for item in completed_items(events, "agent_message")]
    assert messages and messages[-1].strip() == "Patched."
