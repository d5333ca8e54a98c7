"""A newcomer's first harness turn on a config, timed end to end: `python -m serve_app run <config>` (the README's
first command; `--launcher serve` for Ray's own `serve run`), then the README's `claude` line with a fresh home and
`-p "Reply with one short greeting."` — or, with `--harness codex`, docs/codex.md's lines: `python -m serve_app
codex-config` against the running service into a fresh CODEX_HOME, then `codex exec` with the same prompt.

Records how long the service took to become ready (`/health` 200), how long the turn took, the answer, and every
request of the turn from the service's request log (prompt, cached and output tokens, TTFT, duration), with the
command, commit and host. The real CLI comes from npm into `.tools/claude-code` (as the conformance tests do).

    python -m load.bench_first_turn --json load/results/first_turn_cpu.json
    python -m load.bench_first_turn --harness codex --json load/results/first_turn_codex_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from load.bench_capacity import add_launcher_arg, request_log, start_server, stop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "conformance"))  # npm_tools: the project-local CLI install


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"not ready after {timeout_s} s")


def _requests_of(log_path: Path) -> list[dict]:
    """The request-log lines (serve_app/request_log.py: one JSON object per request) in the service's output."""
    keys = ("api", "model", "prompt_tokens", "cached_tokens", "output_tokens", "ttft_s", "duration_s", "finish_reason")
    return [{k: rec.get(k) for k in keys} for rec in request_log(log_path) if "request_id" in rec]


def _codex_home(home: Path, url: str, model: str) -> Path:
    """docs/codex.md's line: the provider block and model catalog from the running service."""
    home.mkdir(parents=True)
    r = subprocess.run([sys.executable, "-m", "serve_app", "codex-config", "--base-url", url, "--model", model,
                        "--catalog-out", str(home / "serve_app_models.json")],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"codex-config failed: {r.stderr[-500:]}")
    (home / "config.toml").write_text(r.stdout)
    return home


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="config.yaml")
    ap.add_argument("--harness", choices=("claude", "codex"), default="claude")
    ap.add_argument("--model", help="the model the harness asks for (claude: claude-sonnet-4-6, codex: "
                                    "smollm2-135m-instruct-32k, as docs/codex.md shows)")
    ap.add_argument("--prompt", default="Reply with one short greeting.")
    ap.add_argument("--port", type=int, default=8000, help="the port the config serves (config.yaml: ingress.listen)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="also set this for claude (e.g. CLAUDE_STREAM_IDLE_TIMEOUT_MS=900000), repeatable")
    ap.add_argument("--json", help="write the result here")
    add_launcher_arg(ap)
    a = ap.parse_args()

    from npm_tools import TOOLS, npm_bin

    from load import provenance

    if a.harness == "claude":
        cli = npm_bin(TOOLS / "claude-code", "@anthropic-ai/claude-code", "claude")
        a.model = a.model or "claude-sonnet-4-6"
    else:
        cli = npm_bin(TOOLS / "codex", "@openai/codex", "codex")
        a.model = a.model or "smollm2-135m-instruct-32k"
    version = subprocess.run([str(cli), "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    url = f"http://127.0.0.1:{a.port}"
    work = Path(tempfile.mkdtemp(prefix="first-turn-"))
    log_path = work / "serve.log"
    with open(log_path, "w") as log:
        proc = start_server(a.config, a.launcher, log)
    try:
        ready_s = _wait_ready(url, proc, 1200)
        (work / "home").mkdir()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work / "home")}
        if a.harness == "claude":
            env.update({"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "any"})  # the README's line, nothing more
            cmd = [str(cli), "--model", a.model, "-p", a.prompt]
        else:
            env["CODEX_HOME"] = str(_codex_home(work / "home" / ".codex", url, a.model))
            cmd = [str(cli), "exec", "--skip-git-repo-check", a.prompt]
        env.update(dict(kv.split("=", 1) for kv in a.env))
        t0 = time.monotonic()
        r = subprocess.run(cmd, cwd=work / "home", env=env, capture_output=True, text=True, timeout=1800,
                           stdin=subprocess.DEVNULL)
        turn_s = time.monotonic() - t0
        time.sleep(2)  # the last request-log line
        requests = _requests_of(log_path)
    finally:
        stop([proc])  # SIGINT to the server's process group, as Ctrl-C
        subprocess.run([str(ROOT / ".venv" / "bin" / "ray"), "stop", "--force"], capture_output=True, timeout=120)
    out = {**provenance.header("load.bench_first_turn", sys.argv[1:]), "config": a.config, "launcher": a.launcher,
           "model": a.model,
           "harness": a.harness, "version": version, "prompt": a.prompt,
           "results": {"ready_s": round(ready_s, 1), "turn_s": round(turn_s, 1), "exit_code": r.returncode,
                       "answer": r.stdout.strip()[-500:], "stderr_tail": r.stderr.strip()[-500:],
                       "requests": requests}}
    print(json.dumps(out, indent=2))
    if a.json:
        provenance.write(a.json, out)


if __name__ == "__main__":
    main()
