"""The real Claude Code CLI against the service: `claude -p` answers, and a forced two-turn Bash tool loop completes
with the second request reusing the first's prompt prefix.

Claude Code is npm-installed at test time into `.tools/claude-code` (gitignored; npm_tools.py); without npm or the registry the
tests say why and skip (fail under CI). The model's words come from `tests/configs/script_rules/anthropic.yaml` (forced scripts
keyed on markers in the prompt), through the real engine.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from npm_tools import CLAUDE_CODE, ensure, unavailable

# The first request carries a ~16-20K-token system prompt and tool set: its cold prefill on the 32K engine takes
# about two minutes on two CPU cores (test_print_mode_answers' call in load/results/ci_run.json), one of the longest
# single steps of CI. It runs anyway: it is the request users send.
pytestmark = [pytest.mark.conformance, pytest.mark.integration]

MODEL = "claude-sonnet-4-6"  # alias of the 32K engine in tests/configs/test.yaml: Claude Code's prompt is ~20K


@pytest.fixture(scope="module")
def claude() -> Path:
    path = ensure(CLAUDE_CODE)
    r = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        unavailable(f"the installed claude binary does not run here: {r.stderr[-300:]}")
    return path


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """One fresh home and working directory for the module's sessions. Claude Code puts the working directory in
    its system prompt, so sessions in one directory share their ~20K-token prefix, as a user's do: only the first
    pays the cold prefill."""
    return tmp_path_factory.mktemp("claude-home")


def run_claude(claude: Path, serve_url: str, home: Path, prompt: str, *extra: str) -> list[dict]:
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),  # a fresh home: no user settings, no login, no history
        "ANTHROPIC_BASE_URL": serve_url,
        "ANTHROPIC_API_KEY": "sk-test-not-checked",
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024",
        "API_TIMEOUT_MS": "900000",
        # Claude Code's stream watchdog does not count `ping`s; a cold ~20K-token prefill on two CPU cores can
        # pass its 300 s default before the first content event.
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1200000",
        "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK": "1",  # a broken stream must fail the test, not be papered over
    }
    # --include-partial-messages: every SSE event of every request is echoed, so the test sees each request's
    # final usage (message_delta), not just the message_start snapshot.
    cmd = [str(claude), "-p", prompt, "--model", MODEL, "--output-format", "stream-json", "--verbose",
           "--include-partial-messages", *extra]
    r = subprocess.run(cmd, cwd=home, env=env, capture_output=True, text=True, timeout=1200)
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert r.returncode == 0, f"claude exited {r.returncode}\nstdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-3000:]}"
    return lines


def test_print_mode_answers(claude, serve_url, home):
    out = run_claude(claude, serve_url, home, "CONFORMANCE_SAY_OK: reply with the word ok")
    result = [o for o in out if o.get("type") == "result"][-1]
    assert result["is_error"] is False, result
    assert result["result"].strip() == "ok"
    usage = result["usage"]
    assert usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) > 5000  # Claude Code's real prompt


def test_two_turn_bash_tool_loop_reuses_the_prefix(claude, serve_url, home):
    out = run_claude(claude, serve_url, home, "CONFORMANCE_BASH_LOOP: run the command",
                     "--allowedTools", "Bash")
    check_bash_loop_reused_the_prefix(out)


def check_bash_loop_reused_the_prefix(out: list[dict]) -> tuple[dict, dict]:
    """The CONFORMANCE_BASH_LOOP session's events: the Bash call, its result, the final answer, and the second
    request finding the first's prompt in the engine's cache. Returns the first and last requests' usage.
    (tests/integration/test_serve_app_run.py runs the same loop on config.yaml.)"""
    assistants = [o["message"] for o in out if o.get("type") == "assistant"]
    calls = [b for m in assistants for b in m["content"] if b["type"] == "tool_use"]
    assert calls and calls[0]["name"] == "Bash" and calls[0]["input"]["command"] == "echo CONFORMANCE_BASH_DONE"
    assert calls[0]["id"].startswith("toolu_")
    results = [b for o in out if o.get("type") == "user" for b in o["message"]["content"]
               if isinstance(b, dict) and b.get("type") == "tool_result"]
    assert results and "CONFORMANCE_BASH_DONE" in json.dumps(results[0]["content"])
    result = [o for o in out if o.get("type") == "result"][-1]
    assert result["is_error"] is False, result
    assert result["result"].strip() == "The command printed CONFORMANCE_BASH_DONE."
    # Turn 2's prompt is turn 1's prompt + the call + its result: the engine must find turn 1's prefix cached.
    finals = [o["event"]["usage"] for o in out
              if o.get("type") == "stream_event" and o["event"]["type"] == "message_delta"]
    assert len(finals) >= 2, finals
    first, last = finals[0], finals[-1]
    first_prompt = first["input_tokens"] + first["cache_read_input_tokens"]
    assert last["cache_read_input_tokens"] >= first_prompt - 256, (first, last)  # all but a partial KV block
    return first, last
