"""npm installs for the real-CLI tests: each CLI goes into its own prefix under `.tools/` (gitignored), never
globally. Without npm or the registry a test says why and skips on a developer's machine, but fails under CI
(`CI` set): a conformance suite that cannot get its CLI has not tested anything, and must not pass."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools"


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


def npm_bin(prefix: Path, package: str, name: str) -> Path:
    """The `name` executable of `package` installed in `prefix`, installing it first if it is missing."""
    path = prefix / "node_modules" / ".bin" / name
    if not path.exists():
        npm_install(prefix, package)
    if not path.exists():
        unavailable(f"npm installed {package} but no `{name}` executable")
    return path
